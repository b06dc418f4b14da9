//! The x86-64 instruction layer the CPU kernels share: [`Isa`], the few instructions in
//! which the AVX-512 and AVX2 kernels differ, with one implementation per instruction
//! set, and the transposes built on it. The integer kernels (`int8/x86.rs`) are written
//! once over it; the `exact` precision's AVX-512 kernels (`avx512.rs`) take its
//! transposes.

/// The few instructions in which the in-register kernels differ between AVX-512 (with
/// VNNI), AVX2 with AVX-VNNI, and AVX2: everything else (the integer kernels'
/// `decode_group` and `multiply_sub`) is written once over 8-lane vectors, generic over
/// this, and compiled into one entry point per instruction set (`group_tile_vnni`,
/// `group_tile_avx_vnni`, `group_tile_avx2`) with its target features. All three give
/// the same integer sums, so the same bits.
pub(crate) trait Isa {
    /// Four vectors of two rows' four u32 words each (rows `2p`, `2p + 1`) to four
    /// vectors of one word of eight rows each.
    ///
    /// # Safety
    ///
    /// The CPU has the instruction set's features.
    unsafe fn transpose4(a: [std::arch::x86_64::__m256i; 4]) -> [std::arch::x86_64::__m256i; 4];

    /// The f16 values in the low halves of the eight 32-bit lanes, as f32.
    ///
    /// # Safety
    ///
    /// As [`transpose4`](Self::transpose4).
    unsafe fn f16_low(v: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256;

    /// `acc + ` each lane's four products of unsigned bytes of `w` (at most 63 on AVX2,
    /// where `vpmaddubsw` saturates pairs at 32767) with signed bytes of `x`.
    ///
    /// # Safety
    ///
    /// As [`transpose4`](Self::transpose4).
    unsafe fn dot4(
        acc: std::arch::x86_64::__m256i,
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i;

    /// `(a & mask) | b`, bit by bit: a field of `a` merged with bits already in place.
    ///
    /// # Safety
    ///
    /// As [`transpose4`](Self::transpose4).
    unsafe fn and_or(
        a: std::arch::x86_64::__m256i,
        mask: std::arch::x86_64::__m256i,
        b: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i;

    /// Bits `2 J` and `2 J + 1` of each byte of `h` moved to bits 4 and 5, the others
    /// zero (Q6_K's high bits of sub-block `J` of a quarter): a shift in 16-bit lanes
    /// and a mask, or where the CPU has GFNI one bit-matrix product per byte
    /// ([`VnniGfni`]).
    ///
    /// # Safety
    ///
    /// As [`transpose4`](Self::transpose4).
    #[inline(always)]
    unsafe fn pair_to_bits45<const J: usize>(
        h: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX2 at least). The mask drops what the 16-bit
        // shifts move across a byte.
        unsafe {
            let moved = match J {
                0 => _mm256_slli_epi16::<4>(h),
                1 => _mm256_slli_epi16::<2>(h),
                2 => h,
                _ => _mm256_srli_epi16::<2>(h),
            };
            _mm256_and_si256(moved, _mm256_set1_epi8(0x30))
        }
    }

    /// Whether [`dot4`](Self::dot4) takes only bytes below 64, so Q8_0's values are
    /// multiplied signed (`|q| * sign(x, q)`) rather than offset by 128.
    const SMALL_BYTES: bool;
}

/// AVX-512 F/BW/VL with VNNI: `vpdpbusd` and two-source permutes. Its methods but
/// `dot4` need only AVX-512 F/VL and F16C (the `exact` AVX-512 kernels use its
/// transposes on CPUs without VNNI).
pub(crate) struct Vnni;

/// AVX2 with FMA and F16C: `vpmaddubsw` then `vpmaddwd`, and unpacks.
pub(crate) struct Avx2;

/// AVX2 with AVX-VNNI (`vpdpbusd` on 256-bit vectors, VEX-encoded: Intel's cores since
/// Alder Lake and its E-core Xeons, which lack AVX-512; AMD since Zen 5): [`Avx2`]'s
/// transposes with [`Vnni`]'s four-byte products, so no pairs to widen and no bound
/// on the bytes.
pub(crate) struct AvxVnni;

/// [`Vnni`] on a CPU that also has GFNI: [`Isa::pair_to_bits45`] in one
/// `vgf2p8affineqb` (a bit matrix per byte) instead of a shift and a mask. Q6_K's
/// decoder moves two high bits per value, and at one row its decoding, not the memory,
/// bounded it (Zen 4; Cascade Lake has VNNI without GFNI and keeps [`Vnni`]).
pub(crate) struct VnniGfni;

impl Isa for Vnni {
    #[inline(always)]
    unsafe fn transpose4(a: [std::arch::x86_64::__m256i; 4]) -> [std::arch::x86_64::__m256i; 4] {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX-512 F/VL).
        unsafe {
            let pick_lo = _mm256_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13);
            let pick_hi = _mm256_setr_epi32(2, 6, 10, 14, 3, 7, 11, 15);
            let low_halves = _mm256_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11);
            let high_halves = _mm256_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15);
            let p01 = _mm256_permutex2var_epi32(a[0], pick_lo, a[1]);
            let p23 = _mm256_permutex2var_epi32(a[0], pick_hi, a[1]);
            let q01 = _mm256_permutex2var_epi32(a[2], pick_lo, a[3]);
            let q23 = _mm256_permutex2var_epi32(a[2], pick_hi, a[3]);
            [
                _mm256_permutex2var_epi32(p01, low_halves, q01),
                _mm256_permutex2var_epi32(p01, high_halves, q01),
                _mm256_permutex2var_epi32(p23, low_halves, q23),
                _mm256_permutex2var_epi32(p23, high_halves, q23),
            ]
        }
    }

    #[inline(always)]
    unsafe fn f16_low(v: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX-512 VL, F16C).
        unsafe { _mm256_cvtph_ps(_mm256_cvtepi32_epi16(v)) }
    }

    #[inline(always)]
    unsafe fn dot4(
        acc: std::arch::x86_64::__m256i,
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        // SAFETY: the caller's contract (AVX-512 VL, VNNI).
        unsafe { std::arch::x86_64::_mm256_dpbusd_epi32(acc, w, x) }
    }

    #[inline(always)]
    unsafe fn and_or(
        a: std::arch::x86_64::__m256i,
        mask: std::arch::x86_64::__m256i,
        b: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        // SAFETY: the caller's contract (AVX-512 F/VL). 0xEA: (a & mask) | b.
        unsafe { std::arch::x86_64::_mm256_ternarylogic_epi32::<0xEA>(a, mask, b) }
    }

    const SMALL_BYTES: bool = false;
}

impl Isa for VnniGfni {
    #[inline(always)]
    unsafe fn transpose4(a: [std::arch::x86_64::__m256i; 4]) -> [std::arch::x86_64::__m256i; 4] {
        // SAFETY: the caller's contract (AVX-512 F/VL).
        unsafe { Vnni::transpose4(a) }
    }

    #[inline(always)]
    unsafe fn f16_low(v: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract (AVX-512 VL, F16C).
        unsafe { Vnni::f16_low(v) }
    }

    #[inline(always)]
    unsafe fn dot4(
        acc: std::arch::x86_64::__m256i,
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        // SAFETY: the caller's contract (AVX-512 VL, VNNI).
        unsafe { Vnni::dot4(acc, w, x) }
    }

    #[inline(always)]
    unsafe fn and_or(
        a: std::arch::x86_64::__m256i,
        mask: std::arch::x86_64::__m256i,
        b: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        // SAFETY: the caller's contract (AVX-512 F/VL).
        unsafe { Vnni::and_or(a, mask, b) }
    }

    #[inline(always)]
    unsafe fn pair_to_bits45<const J: usize>(
        h: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // Output bit `i` of each byte is the parity of the byte AND byte `7 - i` of the
        // matrix: bit 4 takes input bit `2 J` (matrix byte 3), bit 5 input bit `2 J + 1`
        // (matrix byte 2); every other row is zero.
        let matrix = ((1i64 << (2 * J)) << 24) | ((1i64 << (2 * J + 1)) << 16);
        // SAFETY: the caller's contract (GFNI and AVX).
        unsafe { _mm256_gf2p8affine_epi64_epi8::<0>(h, _mm256_set1_epi64x(matrix)) }
    }

    const SMALL_BYTES: bool = false;
}

impl Isa for AvxVnni {
    #[inline(always)]
    unsafe fn transpose4(a: [std::arch::x86_64::__m256i; 4]) -> [std::arch::x86_64::__m256i; 4] {
        // SAFETY: the caller's contract (AVX2).
        unsafe { Avx2::transpose4(a) }
    }

    #[inline(always)]
    unsafe fn f16_low(v: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract (AVX2, F16C).
        unsafe { Avx2::f16_low(v) }
    }

    #[inline(always)]
    unsafe fn dot4(
        acc: std::arch::x86_64::__m256i,
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        // SAFETY: the caller's contract (AVX-VNNI).
        unsafe { std::arch::x86_64::_mm256_dpbusd_avx_epi32(acc, w, x) }
    }

    #[inline(always)]
    unsafe fn and_or(
        a: std::arch::x86_64::__m256i,
        mask: std::arch::x86_64::__m256i,
        b: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        // SAFETY: the caller's contract (AVX2).
        unsafe { Avx2::and_or(a, mask, b) }
    }

    const SMALL_BYTES: bool = false;
}

impl Isa for Avx2 {
    #[inline(always)]
    unsafe fn transpose4(a: [std::arch::x86_64::__m256i; 4]) -> [std::arch::x86_64::__m256i; 4] {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX2).
        unsafe {
            // Per 128-bit half (rows 2p | 2p + 1): words 0-1, then 2-3, of rows 0 and 2
            // (4 and 6) interleaved.
            let lo02 = _mm256_unpacklo_epi32(a[0], a[1]);
            let hi02 = _mm256_unpackhi_epi32(a[0], a[1]);
            let lo46 = _mm256_unpacklo_epi32(a[2], a[3]);
            let hi46 = _mm256_unpackhi_epi32(a[2], a[3]);
            // Word j of rows 0, 2, 4, 6 | 1, 3, 5, 7: put the rows in order.
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            [
                _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(lo02, lo46), order),
                _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi64(lo02, lo46), order),
                _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(hi02, hi46), order),
                _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi64(hi02, hi46), order),
            ]
        }
    }

    #[inline(always)]
    unsafe fn f16_low(v: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX2, F16C).
        unsafe {
            let pick = _mm256_setr_epi8(
                0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13,
                -1, -1, -1, -1, -1, -1, -1, -1,
            );
            let halves = _mm256_permute4x64_epi64::<0b1000>(_mm256_shuffle_epi8(v, pick));
            _mm256_cvtph_ps(_mm256_castsi256_si128(halves))
        }
    }

    #[inline(always)]
    unsafe fn dot4(
        acc: std::arch::x86_64::__m256i,
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX2). Pairs of products stay within i16: at
        // most 2 * 63 * 127 (or 2 * 128 * 127 for Q8_0's signed form).
        unsafe {
            let pairs = _mm256_maddubs_epi16(w, x);
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }

    #[inline(always)]
    unsafe fn and_or(
        a: std::arch::x86_64::__m256i,
        mask: std::arch::x86_64::__m256i,
        b: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX2).
        unsafe { _mm256_or_si256(_mm256_and_si256(a, mask), b) }
    }

    const SMALL_BYTES: bool = true;
}

/// The 32 bytes at `at(i)` for rows `i < 8` to eight vectors of one u32 word of the
/// eight rows each.
///
/// # Safety
///
/// The CPU has `I`'s features; 32 bytes are readable at each `at(i)`.
#[inline(always)]
pub(crate) unsafe fn transpose8<I: Isa>(
    at: impl Fn(usize) -> *const u8,
) -> [std::arch::x86_64::__m256i; 8] {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let mut rows = [_mm256_setzero_si256(); 8];
        for (i, v) in rows.iter_mut().enumerate() {
            *v = _mm256_loadu_si256(at(i).cast());
        }
        let mut first = [_mm256_setzero_si256(); 4];
        let mut last = [_mm256_setzero_si256(); 4];
        for p in 0..4 {
            first[p] = _mm256_permute2x128_si256::<0x20>(rows[2 * p], rows[2 * p + 1]);
            last[p] = _mm256_permute2x128_si256::<0x31>(rows[2 * p], rows[2 * p + 1]);
        }
        let (a, b) = (I::transpose4(first), I::transpose4(last));
        [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
    }
}
