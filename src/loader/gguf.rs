//! Reader for GGUF checkpoints (the llama.cpp / ggml file format, versions 2 and 3).
//!
//! A GGUF file is laid out as
//!
//! ```text
//! magic "GGUF" | version: u32 | tensor_count: u64 | kv_count: u64
//! kv_count x  (key: string, value_type: u32, value)
//! tensor_count x (name: string, n_dims: u32, dims: [u64; n_dims], type: u32, offset: u64)
//! padding to `general.alignment` (default 32)
//! tensor data (each tensor at data_start + offset)
//! ```
//!
//! with every number little-endian and every string a `u64` byte length followed by
//! UTF-8 bytes. [`GgufFile::open`] reads and validates everything up to the tensor data
//! (checking every length against the size of the file, so a cut or corrupt file gives an
//! error rather than a panic or a huge allocation); tensor data is read on demand with
//! [`GgufFile::read_tensor_f32`] or [`GgufFile::read_tensor_bytes`].

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{LlamaError, Result};
use crate::kernels::QuantMatrix;
pub use crate::quant::GgmlType;
use crate::quant::{QuantFormat, dequant};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";

/// Tensor data alignment used when the file has no `general.alignment` key.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Largest number of dimensions a ggml tensor can have.
pub const MAX_DIMS: usize = 4;

/// Upper bound on the number of tensors (far above any real checkpoint).
const MAX_TENSORS: u64 = 1 << 20;
/// Upper bound on the number of metadata entries.
const MAX_KV: u64 = 1 << 20;
/// Upper bound on a single metadata string, in bytes.
const MAX_STRING_LEN: u64 = 1 << 30;
/// Upper bound on the total number of metadata array elements in one file (each one
/// costs a [`GgufValue`] in memory; a tokenizer has a few hundred thousand).
const MAX_ARRAY_ELEMENTS: u64 = 1 << 26;
/// Upper bound on the nesting of metadata arrays.
const MAX_ARRAY_DEPTH: u32 = 8;

// ---------------------------------------------------------------------------------------
// Metadata values
// ---------------------------------------------------------------------------------------

/// A metadata value.
///
/// Strings that are not valid UTF-8 are decoded lossily (invalid sequences become
/// U+FFFD), as GGUF files in the wild occasionally hold such tokenizer entries.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 6.
    F32(f32),
    /// Type 12.
    F64(f64),
    /// Type 7 (any non-zero byte reads as `true`).
    Bool(bool),
    /// Type 8.
    String(String),
    /// Type 9: elements of one type (arrays may nest).
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The value's GGUF type name (`"u32"`, `"string"`, `"array"`, ...).
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "u8",
            GgufValue::I8(_) => "i8",
            GgufValue::U16(_) => "u16",
            GgufValue::I16(_) => "i16",
            GgufValue::U32(_) => "u32",
            GgufValue::I32(_) => "i32",
            GgufValue::U64(_) => "u64",
            GgufValue::I64(_) => "i64",
            GgufValue::F32(_) => "f32",
            GgufValue::F64(_) => "f64",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
        }
    }

    /// The value as an `i128` if it is any integer type.
    fn as_int(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as a `u64` if it is an integer of any type that is non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_int().and_then(|v| u64::try_from(v).ok())
    }

    /// The value as an `i64` if it is an integer of any type that fits.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_int().and_then(|v| i64::try_from(v).ok())
    }

    /// The value as an `f32` if it is a float (`f64` is rounded) or an integer.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            GgufValue::F32(v) => Some(v),
            GgufValue::F64(v) => Some(v as f32),
            _ => self.as_int().map(|v| v as f32),
        }
    }

    /// The value as a `bool` if it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a string slice if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements if the value is an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// Shows scalars in full and arrays as their first few elements and their length.
impl fmt::Display for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 6;
        match self {
            GgufValue::U8(v) => write!(f, "{v}"),
            GgufValue::I8(v) => write!(f, "{v}"),
            GgufValue::U16(v) => write!(f, "{v}"),
            GgufValue::I16(v) => write!(f, "{v}"),
            GgufValue::U32(v) => write!(f, "{v}"),
            GgufValue::I32(v) => write!(f, "{v}"),
            GgufValue::U64(v) => write!(f, "{v}"),
            GgufValue::I64(v) => write!(f, "{v}"),
            GgufValue::F32(v) => write!(f, "{v}"),
            GgufValue::F64(v) => write!(f, "{v}"),
            GgufValue::Bool(v) => write!(f, "{v}"),
            GgufValue::String(s) => write!(f, "{s:?}"),
            GgufValue::Array(items) => {
                f.write_str("[")?;
                for (i, item) in items.iter().take(SHOWN).enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{item}")?;
                }
                if items.len() > SHOWN {
                    write!(f, ", ... ({} elements)", items.len())?;
                }
                f.write_str("]")
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Tensor infos
// ---------------------------------------------------------------------------------------

/// Where and how one tensor is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    /// Tensor name (`"blk.0.attn_q.weight"`, ...).
    pub name: String,
    /// Dimensions as stored: `dims[0]` is the fastest-varying (ggml's `ne` order).
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Absolute byte offset of the tensor's data in the file.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// The shape in row-major order (PyTorch order): the stored dims reversed, so the last
    /// entry varies fastest. A ggml matrix with `ne = [in, out]` has shape `[out, in]`.
    pub fn shape(&self) -> Vec<usize> {
        self.dims
            .iter()
            .rev()
            .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
            .collect()
    }

    /// Number of values (the product of the dims; 1 for a zero-dimensional tensor).
    /// Saturates at `usize::MAX` for impossible dims, which [`GgufFile::open`] rejects.
    pub fn n_elements(&self) -> usize {
        let n = self.n_elements_u64().unwrap_or(u64::MAX);
        usize::try_from(n).unwrap_or(usize::MAX)
    }

    fn n_elements_u64(&self) -> Option<u64> {
        self.dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// Bytes the tensor's data takes in the file, `None` if its type is unknown (or the
    /// dims do not fit the type's blocks).
    pub fn n_bytes(&self) -> Option<u64> {
        self.ty.bytes_for(self.n_elements_u64()?)
    }
}

// ---------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------

/// What went wrong while parsing, before it is tied to a path.
#[derive(Debug)]
enum ParseErrorKind {
    Truncated,
    Invalid,
    Io(std::io::Error),
}

#[derive(Debug)]
struct ParseError {
    kind: ParseErrorKind,
    msg: String,
}

impl ParseError {
    fn invalid(msg: impl Into<String>) -> Self {
        ParseError {
            kind: ParseErrorKind::Invalid,
            msg: msg.into(),
        }
    }

    /// Prefixes the message with where the parser was.
    fn context(mut self, what: impl fmt::Display) -> Self {
        self.msg = format!("{what}: {}", self.msg);
        self
    }

    fn into_llama(self, path: &Path) -> LlamaError {
        let msg = format!("{}: {}", path.display(), self.msg);
        match self.kind {
            ParseErrorKind::Truncated => LlamaError::Truncated(msg),
            ParseErrorKind::Invalid => LlamaError::InvalidFormat(msg),
            ParseErrorKind::Io(e) => LlamaError::io(path, e),
        }
    }
}

type PResult<T> = std::result::Result<T, ParseError>;

/// Adds context to the error of a parse step (the closure only runs on error).
trait Context<T> {
    fn ctx<D: fmt::Display>(self, what: impl FnOnce() -> D) -> PResult<T>;
}

impl<T> Context<T> for PResult<T> {
    fn ctx<D: fmt::Display>(self, what: impl FnOnce() -> D) -> PResult<T> {
        self.map_err(|e| e.context(what()))
    }
}

/// A reader that knows its position and how many bytes remain, so every length can be
/// checked before anything is allocated.
struct Cursor<R> {
    inner: R,
    pos: u64,
    len: u64,
    /// Metadata array elements still allowed (see [`MAX_ARRAY_ELEMENTS`]).
    element_budget: u64,
}

/// Smallest encoded size of a metadata value of the given type id, `None` if the id is
/// not a value type.
fn min_value_size(ty: u32) -> Option<u64> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

impl<R: Read> Cursor<R> {
    fn new(inner: R, len: u64) -> Self {
        Cursor {
            inner,
            pos: 0,
            len,
            element_budget: MAX_ARRAY_ELEMENTS,
        }
    }

    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    /// Fails with a truncation error unless `n` more bytes exist.
    fn need(&self, n: u64) -> PResult<()> {
        self.need_impl(n, "")
    }

    /// Like [`need`](Self::need), for a lower bound on what is needed.
    fn need_at_least(&self, n: u64) -> PResult<()> {
        self.need_impl(n, "at least ")
    }

    fn need_impl(&self, n: u64, qualifier: &str) -> PResult<()> {
        if n > self.remaining() {
            Err(ParseError {
                kind: ParseErrorKind::Truncated,
                msg: format!(
                    "needs {qualifier}{n} bytes at offset {} but the file ends at byte {} \
                     (the file is truncated or corrupt)",
                    self.pos, self.len
                ),
            })
        } else {
            Ok(())
        }
    }

    fn fill(&mut self, buf: &mut [u8]) -> PResult<()> {
        self.need(buf.len() as u64)?;
        self.inner.read_exact(buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                ParseError {
                    kind: ParseErrorKind::Truncated,
                    msg: format!("the file ended early near offset {}", self.pos),
                }
            } else {
                ParseError {
                    kind: ParseErrorKind::Io(e),
                    msg: String::new(),
                }
            }
        })?;
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn bytes<const N: usize>(&mut self) -> PResult<[u8; N]> {
        let mut buf = [0u8; N];
        self.fill(&mut buf)?;
        Ok(buf)
    }

    fn u32(&mut self) -> PResult<u32> {
        self.bytes().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> PResult<u64> {
        self.bytes().map(u64::from_le_bytes)
    }

    /// Reads `n` bytes into a new vector (after checking they exist).
    fn vec(&mut self, n: u64) -> PResult<Vec<u8>> {
        self.need(n)?;
        let n = usize::try_from(n)
            .map_err(|_| ParseError::invalid(format!("{n} bytes do not fit in memory")))?;
        let mut buf = vec![0u8; n];
        self.fill(&mut buf)?;
        Ok(buf)
    }

    fn string(&mut self) -> PResult<String> {
        let len = self.u64().ctx(|| "string length")?;
        if len > MAX_STRING_LEN {
            return Err(ParseError::invalid(format!(
                "string length {len} at offset {} is implausible (corrupt file)",
                self.pos - 8
            )));
        }
        let bytes = self.vec(len).ctx(|| format!("string of {len} bytes"))?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// Reads one metadata value of type id `ty`.
    fn value(&mut self, ty: u32, depth: u32) -> PResult<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(u8::from_le_bytes(self.bytes()?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.bytes()?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.bytes()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.bytes()?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.bytes()?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.bytes()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.bytes()?)),
            7 => GgufValue::Bool(self.bytes::<1>()?[0] != 0),
            8 => GgufValue::String(self.string()?),
            9 => self.array(depth)?,
            10 => GgufValue::U64(u64::from_le_bytes(self.bytes()?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.bytes()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.bytes()?)),
            other => {
                return Err(ParseError::invalid(format!(
                    "unknown metadata value type {other} at offset {}",
                    self.pos.saturating_sub(4)
                )));
            }
        })
    }

    fn array(&mut self, depth: u32) -> PResult<GgufValue> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(ParseError::invalid(format!(
                "metadata arrays nested more than {MAX_ARRAY_DEPTH} deep"
            )));
        }
        let elem_ty = self.u32().ctx(|| "array element type")?;
        let count = self.u64().ctx(|| "array length")?;
        let Some(min) = min_value_size(elem_ty) else {
            return Err(ParseError::invalid(format!(
                "unknown array element type {elem_ty} at offset {}",
                self.pos - 12
            )));
        };
        // Every element takes at least `min` bytes: a count the rest of the file cannot
        // hold is caught here, before anything is allocated.
        let min_bytes = count.saturating_mul(min);
        self.need_at_least(min_bytes)
            .ctx(|| format!("array of {count} elements of type {elem_ty}"))?;
        if count > self.element_budget {
            return Err(ParseError::invalid(format!(
                "metadata arrays hold more than {MAX_ARRAY_ELEMENTS} elements in total"
            )));
        }
        self.element_budget -= count;
        let n = count as usize; // bounded by the element budget
        let items = match elem_ty {
            // Fixed-size elements: one bulk read, then decode.
            0 | 1 | 7 => {
                let raw = self.vec(count)?;
                match elem_ty {
                    0 => raw.into_iter().map(GgufValue::U8).collect(),
                    1 => raw.into_iter().map(|b| GgufValue::I8(b as i8)).collect(),
                    _ => raw.into_iter().map(|b| GgufValue::Bool(b != 0)).collect(),
                }
            }
            2 | 3 => {
                let raw = self.vec(min_bytes)?;
                let chunks = raw.as_chunks::<2>().0.iter();
                if elem_ty == 2 {
                    chunks
                        .map(|c| GgufValue::U16(u16::from_le_bytes(*c)))
                        .collect()
                } else {
                    chunks
                        .map(|c| GgufValue::I16(i16::from_le_bytes(*c)))
                        .collect()
                }
            }
            4..=6 => {
                let raw = self.vec(min_bytes)?;
                let chunks = raw.as_chunks::<4>().0.iter();
                match elem_ty {
                    4 => chunks
                        .map(|c| GgufValue::U32(u32::from_le_bytes(*c)))
                        .collect(),
                    5 => chunks
                        .map(|c| GgufValue::I32(i32::from_le_bytes(*c)))
                        .collect(),
                    _ => chunks
                        .map(|c| GgufValue::F32(f32::from_le_bytes(*c)))
                        .collect(),
                }
            }
            10..=12 => {
                let raw = self.vec(min_bytes)?;
                let chunks = raw.as_chunks::<8>().0.iter();
                match elem_ty {
                    10 => chunks
                        .map(|c| GgufValue::U64(u64::from_le_bytes(*c)))
                        .collect(),
                    11 => chunks
                        .map(|c| GgufValue::I64(i64::from_le_bytes(*c)))
                        .collect(),
                    _ => chunks
                        .map(|c| GgufValue::F64(f64::from_le_bytes(*c)))
                        .collect(),
                }
            }
            // Strings and nested arrays, one at a time.
            _ => {
                let mut items = Vec::with_capacity(n);
                for i in 0..n {
                    let item = self
                        .value(elem_ty, depth + 1)
                        .ctx(|| format!("array element #{i}"))?;
                    items.push(item);
                }
                items
            }
        };
        Ok(GgufValue::Array(items))
    }
}

/// Everything [`GgufFile::open`] learns before the tensor data.
struct Header {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    by_name: HashMap<String, usize>,
}

/// Parses and validates a whole GGUF header from `reader`, which holds `len` bytes.
fn parse_header<R: Read>(reader: R, len: u64) -> PResult<Header> {
    let mut c = Cursor::new(reader, len);

    // Magic: a short file that starts like "GGUF" is truncated; anything else is foreign.
    let shown = usize::try_from(len.min(4)).unwrap_or(4);
    let mut magic = [0u8; 4];
    c.fill(&mut magic[..shown]).ctx(|| "magic")?;
    if magic[..shown] != GGUF_MAGIC[..shown] {
        return Err(ParseError::invalid(format!(
            "not a GGUF file (magic \"{}\", expected \"GGUF\")",
            magic[..shown].escape_ascii()
        )));
    }
    if shown < 4 {
        return Err(ParseError {
            kind: ParseErrorKind::Truncated,
            msg: format!("the file is only {len} bytes, too short for a GGUF header"),
        });
    }

    let version = c.u32().ctx(|| "header (version)")?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(ParseError::invalid(
                "GGUF version 1 is not supported (only versions 2 and 3)",
            ));
        }
        v if v > 0xFFFF && v.swap_bytes() <= 3 => {
            return Err(ParseError::invalid(
                "big-endian GGUF files are not supported",
            ));
        }
        v => {
            return Err(ParseError::invalid(format!(
                "unsupported GGUF version {v} (only versions 2 and 3)"
            )));
        }
    }
    let tensor_count = c.u64().ctx(|| "header (tensor count)")?;
    let kv_count = c.u64().ctx(|| "header (metadata count)")?;
    if tensor_count > MAX_TENSORS {
        return Err(ParseError::invalid(format!(
            "header claims {tensor_count} tensors (corrupt file)"
        )));
    }
    if kv_count > MAX_KV {
        return Err(ParseError::invalid(format!(
            "header claims {kv_count} metadata entries (corrupt file)"
        )));
    }
    // Each metadata entry takes at least 13 bytes, each tensor info at least 24.
    c.need_at_least(kv_count * 13 + tensor_count * 24).ctx(|| {
        format!("header promises {kv_count} metadata entries and {tensor_count} tensors")
    })?;

    let mut metadata = BTreeMap::new();
    for i in 0..kv_count {
        let key = c.string().ctx(|| format!("metadata entry #{i} (key)"))?;
        let value = c
            .u32()
            .and_then(|ty| c.value(ty, 0))
            .ctx(|| format!("metadata entry #{i} (`{key}`)"))?;
        if metadata.contains_key(&key) {
            return Err(ParseError::invalid(format!(
                "metadata key `{key}` appears twice"
            )));
        }
        metadata.insert(key, value);
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 30 => a,
            _ => {
                return Err(ParseError::invalid(format!(
                    "general.alignment is {v}, not a power of two"
                )));
            }
        },
    };

    let mut tensors = Vec::with_capacity(tensor_count as usize);
    let mut by_name = HashMap::with_capacity(tensor_count as usize);
    for i in 0..tensor_count {
        let name = c.string().ctx(|| format!("tensor info #{i} (name)"))?;
        let what = || format!("tensor info #{i} (`{name}`)");
        let n_dims = c.u32().ctx(what)?;
        if n_dims as usize > MAX_DIMS {
            return Err(ParseError::invalid(format!(
                "tensor `{name}` has {n_dims} dimensions (at most {MAX_DIMS} are allowed)"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64().ctx(what)?);
        }
        let ty = GgmlType::from_id(c.u32().ctx(what)?);
        let offset = c.u64().ctx(what)?;
        let info = GgufTensorInfo {
            name,
            dims,
            ty,
            offset,
        };
        validate_tensor_shape(&info, alignment)?;
        if by_name.insert(info.name.clone(), tensors.len()).is_some() {
            return Err(ParseError::invalid(format!(
                "tensor `{}` appears twice",
                info.name
            )));
        }
        tensors.push(info);
    }

    let data_offset = c.pos.checked_next_multiple_of(alignment).ok_or_else(|| {
        ParseError::invalid("the tensor data offset overflows (corrupt file)".to_string())
    })?;
    // Make offsets absolute and check every tensor lies inside the file.
    for t in &mut tensors {
        let start = data_offset.checked_add(t.offset).ok_or_else(|| {
            ParseError::invalid(format!("tensor `{}` has an impossible offset", t.name))
        })?;
        t.offset = start;
        let size = t.n_bytes().unwrap_or(0);
        let end = start.checked_add(size).ok_or_else(|| {
            ParseError::invalid(format!("tensor `{}` has an impossible offset", t.name))
        })?;
        if end > len {
            return Err(ParseError {
                kind: ParseErrorKind::Truncated,
                msg: format!(
                    "data of tensor `{}` ({} bytes at offset {start}) runs past the end of \
                     the file at byte {len} (the file is truncated or corrupt)",
                    t.name, size
                ),
            });
        }
    }
    check_overlaps(&tensors)?;

    Ok(Header {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
        by_name,
    })
}

/// Parses `bytes` as a whole GGUF file's header, metadata and tensor infos, as
/// [`GgufFile::open`] does, and formats what it read; the number of metadata entries and
/// tensors. For [`crate::fuzzing`].
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check_header_bytes(bytes: &[u8]) -> Result<(usize, usize)> {
    let header =
        parse_header(bytes, bytes.len() as u64).map_err(|e| e.into_llama(Path::new("<memory>")))?;
    for (key, value) in &header.metadata {
        // Every accessor of a value, and its display (what errors and `short` show).
        let _ = (key.len(), value.type_name(), value.to_string().len());
        let _ = (
            value.as_u64(),
            value.as_i64(),
            value.as_f32(),
            value.as_bool(),
        );
        let _ = (value.as_str(), value.as_array().map(<[GgufValue]>::len));
        let _ = short(value);
    }
    for info in &header.tensors {
        let _ = (info.shape(), info.n_elements(), info.n_bytes());
        // The data [`GgufFile::read_tensor_f32`] would read (it lies inside `bytes`:
        // checked above), dequantized as it would be.
        let Some(size) = info.n_bytes() else { continue };
        if !info.ty.can_dequantize() {
            continue;
        }
        let range = usize::try_from(info.offset)
            .ok()
            .zip(usize::try_from(size).ok())
            .and_then(|(start, size)| bytes.get(start..start.checked_add(size)?));
        if let Some(data) = range {
            let _ = dequant::dequantize(info.ty, data, info.n_elements())?;
        }
    }
    Ok((header.metadata.len(), header.tensors.len()))
}

/// Checks a freshly read tensor info: element count, block divisibility, offset alignment.
fn validate_tensor_shape(info: &GgufTensorInfo, alignment: u64) -> PResult<()> {
    let name = &info.name;
    let Some(n) = info.n_elements_u64().filter(|&n| n <= i64::MAX as u64) else {
        return Err(ParseError::invalid(format!(
            "tensor `{name}` has impossible dimensions {:?}",
            info.dims
        )));
    };
    if let Some(block) = info.ty.block_size() {
        let row = info.dims.first().copied().unwrap_or(1);
        if !row.is_multiple_of(block as u64) {
            return Err(ParseError::invalid(format!(
                "tensor `{name}` has rows of {row} values, not a multiple of the {} block \
                 size {block}",
                info.ty
            )));
        }
        if info.ty.bytes_for(n).is_none() {
            return Err(ParseError::invalid(format!("tensor `{name}` is too large")));
        }
    }
    if !info.offset.is_multiple_of(alignment) {
        return Err(ParseError::invalid(format!(
            "tensor `{name}` has offset {} which is not a multiple of the alignment {alignment}",
            info.offset
        )));
    }
    Ok(())
}

/// Rejects tensors whose data ranges overlap (a sign of a corrupt header).
fn check_overlaps(tensors: &[GgufTensorInfo]) -> PResult<()> {
    let mut ranges: Vec<(u64, u64, &str)> = tensors
        .iter()
        .filter_map(|t| {
            let end = t.offset.saturating_add(t.n_bytes()?);
            Some((t.offset, end, t.name.as_str()))
        })
        .filter(|(s, e, _)| e > s)
        .collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        if let [(_, end_a, a), (start_b, _, b)] = pair
            && start_b < end_a
        {
            return Err(ParseError::invalid(format!(
                "the data of tensors `{a}` and `{b}` overlap (corrupt file)"
            )));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The file
// ---------------------------------------------------------------------------------------

/// An open GGUF checkpoint: its metadata and tensor infos, with tensor data read on
/// demand.
///
/// The file stays open; reads from several threads are safe (they are serialised).
pub struct GgufFile {
    path: PathBuf,
    file: Mutex<File>,
    file_len: u64,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    by_name: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("file_len", &self.file_len)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Opens a GGUF file and reads its header, metadata and tensor infos.
    ///
    /// Errors: [`LlamaError::Io`] if the file cannot be read,
    /// [`LlamaError::InvalidFormat`] if it is not GGUF (wrong magic, unsupported version,
    /// corrupt header), [`LlamaError::Truncated`] if it ends before the header or the
    /// tensor data it describes. A tensor of unknown type does not fail here.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| LlamaError::io(&path, e))?;
        let file_len = file.metadata().map_err(|e| LlamaError::io(&path, e))?.len();
        let header = parse_header(BufReader::with_capacity(1 << 20, &file), file_len)
            .map_err(|e| e.into_llama(&path))?;
        Ok(GgufFile {
            path,
            file: Mutex::new(file),
            file_len,
            version: header.version,
            alignment: header.alignment,
            data_offset: header.data_offset,
            metadata: header.metadata,
            tensors: header.tensors,
            by_name: header.by_name,
        })
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset where the tensor data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Size of the file in bytes.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    /// One metadata value, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// `general.architecture` (`"llama"`, `"qwen2"`, ...).
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    fn required<T>(&self, key: &str, value: Result<Option<T>>) -> Result<T> {
        value?.ok_or_else(|| LlamaError::Config(format!("missing metadata key `{key}`")))
    }

    fn opt<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        convert: impl FnOnce(&'a GgufValue) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => convert(v).map(Some).ok_or_else(|| {
                LlamaError::Config(format!(
                    "invalid metadata key `{key}`: {} {}, expected {expected}",
                    v.type_name(),
                    short(v)
                ))
            }),
        }
    }

    fn opt_array<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        convert: impl Fn(&'a GgufValue) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some(items) = self.opt(key, &format!("an array of {expected}"), |v| v.as_array())?
        else {
            return Ok(None);
        };
        items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                convert(v).ok_or_else(|| {
                    LlamaError::Config(format!(
                        "invalid metadata key `{key}`: element #{i} is {} {}, expected {expected}",
                        v.type_name(),
                        short(v)
                    ))
                })
            })
            .collect::<Result<Vec<T>>>()
            .map(Some)
    }

    /// An optional non-negative integer (stored as any integer type).
    pub fn get_opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.opt(key, "a non-negative integer", GgufValue::as_u64)
    }

    /// A required non-negative integer (stored as any integer type).
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.required(key, self.get_opt_u64(key))
    }

    /// An optional integer that fits in a `usize` (stored as any integer type).
    pub fn get_opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.opt(key, "a non-negative integer", |v| {
            v.as_u64().and_then(|n| usize::try_from(n).ok())
        })
    }

    /// A required integer that fits in a `usize` (stored as any integer type).
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        self.required(key, self.get_opt_usize(key))
    }

    /// An optional float (stored as `f32`, `f64` or an integer).
    pub fn get_opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.opt(key, "a number", GgufValue::as_f32)
    }

    /// A required float (stored as `f32`, `f64` or an integer).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.required(key, self.get_opt_f32(key))
    }

    /// An optional string.
    pub fn get_opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.opt(key, "a string", GgufValue::as_str)
    }

    /// A required string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.required(key, self.get_opt_str(key))
    }

    /// An optional boolean.
    pub fn get_opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.opt(key, "a bool", GgufValue::as_bool)
    }

    /// A required boolean.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.required(key, self.get_opt_bool(key))
    }

    /// An optional array of strings (for example `tokenizer.ggml.merges`).
    pub fn get_opt_string_array(&self, key: &str) -> Result<Option<Vec<String>>> {
        self.opt_array(key, "strings", |v| v.as_str().map(str::to_owned))
    }

    /// A required array of strings (for example `tokenizer.ggml.tokens`).
    pub fn get_string_array(&self, key: &str) -> Result<Vec<String>> {
        self.required(key, self.get_opt_string_array(key))
    }

    /// An optional array of integers that fit in `i32` (any integer element type).
    pub fn get_opt_i32_array(&self, key: &str) -> Result<Option<Vec<i32>>> {
        self.opt_array(key, "integers that fit in i32", |v| {
            v.as_i64().and_then(|n| i32::try_from(n).ok())
        })
    }

    /// A required array of integers that fit in `i32` (for example
    /// `tokenizer.ggml.token_type`).
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.required(key, self.get_opt_i32_array(key))
    }

    /// An optional array of floats (any float or integer element type).
    pub fn get_opt_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        self.opt_array(key, "numbers", GgufValue::as_f32)
    }

    /// A required array of floats (for example `tokenizer.ggml.scores`).
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        self.required(key, self.get_opt_f32_array(key))
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The info of the tensor called `name`, if present.
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.by_name.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// Total bytes of all tensors' data (tensors of unknown type count as 0), for
    /// progress reporting.
    pub fn tensor_data_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.n_bytes().unwrap_or(0))
            .fold(0u64, u64::saturating_add)
    }

    /// Reads the raw bytes of a tensor's data.
    ///
    /// Errors: [`LlamaError::UnsupportedTensorType`] if the tensor's type is unknown (its
    /// size cannot be known), [`LlamaError::Truncated`] if the data lies past the end of
    /// the file, [`LlamaError::Io`] on a read error.
    pub fn read_tensor_bytes(&self, info: &GgufTensorInfo) -> Result<Vec<u8>> {
        let Some(size) = info.n_bytes() else {
            return Err(LlamaError::UnsupportedTensorType {
                name: info.name.clone(),
                ty: info.ty.to_string(),
            });
        };
        let truncated = || {
            LlamaError::Truncated(format!(
                "{}: data of tensor `{}` ({size} bytes at offset {}) runs past the end of \
                 the file",
                self.path.display(),
                info.name,
                info.offset
            ))
        };
        let end = info.offset.checked_add(size).ok_or_else(truncated)?;
        if end > self.file_len {
            return Err(truncated());
        }
        let size = usize::try_from(size).map_err(|_| truncated())?;
        let mut buf = vec![0u8; size];
        // A poisoned lock only means another reader panicked; the file is still usable
        // because every read seeks first.
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        file.seek(SeekFrom::Start(info.offset))
            .map_err(|e| LlamaError::io(&self.path, e))?;
        file.read_exact(&mut buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                truncated()
            } else {
                LlamaError::io(&self.path, e)
            }
        })?;
        Ok(buf)
    }

    /// Reads a tensor and dequantizes it to `f32`; returns its row-major shape (see
    /// [`GgufTensorInfo::shape`]) and values.
    ///
    /// Errors: [`LlamaError::MissingTensor`] if there is no tensor called `name`,
    /// [`LlamaError::UnsupportedTensorType`] if its type cannot be dequantized (see
    /// [`GgmlType::can_dequantize`]), and the errors of
    /// [`read_tensor_bytes`](Self::read_tensor_bytes).
    pub fn read_tensor_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| LlamaError::MissingTensor(name.to_string()))?;
        if !info.ty.can_dequantize() {
            return Err(LlamaError::UnsupportedTensorType {
                name: info.name.clone(),
                ty: info.ty.to_string(),
            });
        }
        let bytes = self.read_tensor_bytes(info)?;
        let data =
            dequant::dequantize(info.ty, &bytes, info.n_elements()).map_err(|e| match e {
                LlamaError::InvalidFormat(msg) => {
                    LlamaError::InvalidFormat(format!("tensor `{name}`: {msg}"))
                }
                other => other,
            })?;
        Ok((info.shape(), data))
    }
}

/// A short rendering of a value for error messages.
fn short(v: &GgufValue) -> String {
    let s = v.to_string();
    if s.chars().count() > 60 {
        let cut: String = s.chars().take(57).collect();
        format!("{cut}...")
    } else {
        s
    }
}

/// Reading a kept block format's tensor as the kernels' matrix (here, with the reader,
/// so the kernels need not know the file format).
impl QuantMatrix {
    /// The tensor `name` of a GGUF file (its GGUF name) as a matrix of its rows, all but
    /// the last dimension flattened into rows; `None` if its type is not one of
    /// [`QuantFormat`]'s. No llama.cpp row permutation is undone (the model loader does
    /// that for queries and keys).
    ///
    /// # Errors
    ///
    /// [`LlamaError::MissingTensor`] if the file has no such tensor, and what reading it
    /// or [`QuantMatrix::new`] reports.
    pub fn from_gguf(gguf: &GgufFile, name: &str) -> Result<Option<Self>> {
        let info = gguf
            .tensor_info(name)
            .ok_or_else(|| LlamaError::MissingTensor(name.to_string()))?;
        let Some(format) = QuantFormat::from_ggml(info.ty) else {
            return Ok(None);
        };
        let shape = info.shape();
        let cols = shape.last().copied().unwrap_or(0);
        let rows = shape[..shape.len().saturating_sub(1)].iter().product();
        Self::new(format, rows, cols, gguf.read_tensor_bytes(info)?).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;

    /// A minimal GGUF writer for tests.
    #[derive(Default)]
    struct Builder {
        kv: Vec<u8>,
        n_kv: u64,
        infos: Vec<u8>,
        n_tensors: u64,
        data: Vec<u8>,
    }

    fn put_str(buf: &mut Vec<u8>, s: &str) {
        buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
        buf.extend_from_slice(s.as_bytes());
    }

    impl Builder {
        fn kv_raw(&mut self, key: &str, ty: u32, value: &[u8]) -> &mut Self {
            put_str(&mut self.kv, key);
            self.kv.extend_from_slice(&ty.to_le_bytes());
            self.kv.extend_from_slice(value);
            self.n_kv += 1;
            self
        }

        fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: &[u8]) -> &mut Self {
            put_str(&mut self.infos, name);
            self.infos
                .extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                self.infos.extend_from_slice(&d.to_le_bytes());
            }
            self.infos.extend_from_slice(&ty.to_le_bytes());
            while !self.data.len().is_multiple_of(32) {
                self.data.push(0);
            }
            self.infos
                .extend_from_slice(&(self.data.len() as u64).to_le_bytes());
            self.data.extend_from_slice(data);
            self.n_tensors += 1;
            self
        }

        fn build(&self) -> Vec<u8> {
            let mut out = b"GGUF".to_vec();
            out.extend_from_slice(&3u32.to_le_bytes());
            out.extend_from_slice(&self.n_tensors.to_le_bytes());
            out.extend_from_slice(&self.n_kv.to_le_bytes());
            out.extend_from_slice(&self.kv);
            out.extend_from_slice(&self.infos);
            while !out.len().is_multiple_of(32) {
                out.push(0);
            }
            out.extend_from_slice(&self.data);
            out
        }
    }

    fn parse(bytes: &[u8]) -> PResult<Header> {
        parse_header(bytes, bytes.len() as u64)
    }

    fn sample() -> Vec<u8> {
        let mut b = Builder::default();
        let mut arr = 8u32.to_le_bytes().to_vec();
        arr.extend_from_slice(&2u64.to_le_bytes());
        put_str(&mut arr, "ab");
        put_str(&mut arr, "c\u{e9}");
        let mut s = Vec::new();
        put_str(&mut s, "llama");
        b.kv_raw("general.architecture", 8, &s)
            .kv_raw("n", 4, &7u32.to_le_bytes())
            .kv_raw("neg", 5, &(-3i32).to_le_bytes())
            .kv_raw("arr", 9, &arr)
            .tensor("a", &[3, 2], 0, &[0u8; 24])
            .tensor("b", &[32], 8, &[0u8; 34]);
        b.build()
    }

    #[test]
    fn parses_sample() {
        let h = parse(&sample()).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.metadata["n"], GgufValue::U32(7));
        assert_eq!(
            h.metadata["arr"],
            GgufValue::Array(vec![
                GgufValue::String("ab".into()),
                GgufValue::String("c\u{e9}".into())
            ])
        );
        assert_eq!(h.tensors.len(), 2);
        assert_eq!(h.tensors[0].shape(), vec![2, 3]);
        assert_eq!(h.tensors[1].offset, h.data_offset + 32);
    }

    #[test]
    fn every_prefix_fails_cleanly() {
        let bytes = sample();
        for cut in 0..bytes.len() {
            match parse(&bytes[..cut]) {
                Err(ParseError {
                    kind: ParseErrorKind::Truncated,
                    ..
                }) => {}
                Err(e) => panic!("cut at {cut}: unexpected error {e:?}"),
                Ok(_) => panic!("cut at {cut}: parsed"),
            }
        }
    }

    #[test]
    fn corrupt_bytes_never_panic() {
        let bytes = sample();
        // Flip every byte to a few values; anything may come out but a panic.
        for i in 0..bytes.len() {
            for v in [0x00, 0xFF, 0x7F, 0x80, 0x09, 0x40] {
                let mut b = bytes.clone();
                b[i] = v;
                let _ = parse(&b);
            }
        }
    }

    #[test]
    fn absurd_lengths_are_errors() {
        let mut b = Builder::default();
        let mut arr = 8u32.to_le_bytes().to_vec();
        arr.extend_from_slice(&(1u64 << 60).to_le_bytes());
        b.kv_raw("arr", 9, &arr);
        assert_err!(
            parse(&b.build()),
            ParseError {
                kind: ParseErrorKind::Truncated,
                msg,
            } if msg.contains("array of 1152921504606846976 elements")
        );

        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.extend_from_slice(&(1u64 << 60).to_le_bytes());
        bytes.extend_from_slice(&[b'x'; 40]);
        assert!(matches!(
            parse(&bytes),
            Err(ParseError {
                kind: ParseErrorKind::Invalid,
                ..
            })
        ));
    }

    #[test]
    fn rejects_misaligned_or_overlapping_tensors() {
        let mut b = Builder::default();
        b.tensor("a", &[8], 0, &[0u8; 32]);
        let mut bytes = b.build();
        // The offset field is the last 8 bytes of the single tensor info.
        let off_pos = 24 + 8 + 1 + 4 + 8 + 4;
        bytes[off_pos] = 4;
        assert_err!(
            parse(&bytes),
            ParseError {
                kind: ParseErrorKind::Invalid,
                msg,
            } if msg.contains("offset 4 which is not a multiple of the alignment")
        );

        let mut b = Builder::default();
        b.tensor("a", &[8], 0, &[0u8; 32])
            .tensor("b", &[8], 0, &[0u8; 32]);
        let mut bytes = b.build();
        // Point b at a's data.
        let b_off = 24 + (8 + 1 + 4 + 8 + 4 + 8) + (8 + 1 + 4 + 8 + 4);
        bytes[b_off] = 0;
        assert_err!(
            parse(&bytes),
            ParseError {
                kind: ParseErrorKind::Invalid,
                msg,
            } if msg.contains("tensors `a` and `b` overlap")
        );
    }

    #[test]
    fn rejects_versions_and_big_endian() {
        let mut bytes = sample();
        bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert_err!(
            parse(&bytes),
            ParseError {
                kind: ParseErrorKind::Invalid,
                msg,
            } if msg.contains("version 1 is not supported")
        );
        bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
        let err = parse(&bytes).err().map(|e| e.msg).unwrap_or_default();
        assert!(err.contains("big-endian"), "{err}");
        bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
        assert!(parse(&bytes).is_ok());
    }
}
