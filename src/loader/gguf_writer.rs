//! Writer for GGUF files (version 3), streaming: the header, the metadata and the
//! tensor infos are written first (every tensor's type and shape are declared up
//! front, so its offset is known), then the tensors' data in declared order, in pieces
//! of any size. Memory stays bounded by the largest piece the caller hands over, so an
//! 8B model's file is written without holding it.
//!
//! The layout is the one [`GgufFile`](super::gguf::GgufFile) reads (see
//! [`gguf`](super::gguf)): tensor data starts at the first multiple of the alignment
//! (`general.alignment` if the metadata sets it, else 32) after the tensor infos, and
//! each tensor starts at a multiple of it, zero bytes padding between.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::gguf::{DEFAULT_ALIGNMENT, GGUF_MAGIC, GgmlType, GgufValue, MAX_DIMS};
use crate::error::{LlamaError, Result};

/// A tensor the file will hold: its name, its shape in row-major order (PyTorch order;
/// the last entry varies fastest, as [`GgufTensorInfo::shape`](super::gguf::GgufTensorInfo::shape)
/// gives it) and its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlan {
    /// Tensor name (`"blk.0.attn_q.weight"`, ...).
    pub name: String,
    /// Row-major shape: a matrix of `rows` rows of `cols` values is `[rows, cols]`.
    pub shape: Vec<usize>,
    /// Storage type; the last dimension must be a whole number of its blocks.
    pub ty: GgmlType,
}

impl TensorPlan {
    /// A plan for `name`, `shape` in `ty`.
    pub fn new(name: impl Into<String>, shape: &[usize], ty: GgmlType) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
            ty,
        }
    }

    /// Bytes of the tensor's data.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidFormat`] if the type has no known block layout, the rows are
    /// not whole blocks, or the size overflows.
    pub fn n_bytes(&self) -> Result<u64> {
        let bad = |why: &str| {
            LlamaError::InvalidFormat(format!(
                "tensor `{}` of shape {:?} in {}: {why}",
                self.name, self.shape, self.ty
            ))
        };
        let block = self.ty.block_size().ok_or_else(|| bad("unknown type"))?;
        let cols = self.shape.last().copied().unwrap_or(1);
        if !cols.is_multiple_of(block) {
            return Err(bad("rows are not a whole number of the type's blocks"));
        }
        let n = self
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
            .ok_or_else(|| bad("too many values"))?;
        self.ty.bytes_for(n).ok_or_else(|| bad("too many values"))
    }
}

/// Writes one GGUF file: [`create`](Self::create) writes everything up to the tensor
/// data; [`write`](Self::write) appends tensor data in declared order;
/// [`finish`](Self::finish) checks that every tensor was written whole and flushes.
pub struct GgufWriter<W: Write = BufWriter<File>> {
    out: W,
    path: PathBuf,
    tensors: Vec<(TensorPlan, u64)>,
    alignment: u64,
    /// Bytes written so far (the position in the file).
    position: u64,
    /// The tensor being written and the bytes of it written so far.
    current: usize,
    done: u64,
}

impl GgufWriter<BufWriter<File>> {
    /// Creates (or truncates) `path` and writes the header, `metadata` (in the order
    /// given) and the infos of `tensors`.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Io`] if the file cannot be written; [`LlamaError::InvalidFormat`]
    /// for a plan it cannot hold (see [`GgufWriter::new`]).
    pub fn create(
        path: impl AsRef<Path>,
        metadata: &[(String, GgufValue)],
        tensors: Vec<TensorPlan>,
    ) -> Result<Self> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|e| LlamaError::io(path, e))?;
        GgufWriter::new(
            BufWriter::with_capacity(1 << 20, file),
            path,
            metadata,
            tensors,
        )
    }
}

impl<W: Write> GgufWriter<W> {
    /// Writes the header, `metadata` and the tensor infos to `out`; `path` names it in
    /// errors.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidFormat`] for a tensor of more than four dimensions, of an
    /// unknown type or not of whole blocks, for two tensors of one name, for an array
    /// whose elements differ in type, or for a `general.alignment` that is not a
    /// positive power of two below 2^16; [`LlamaError::Io`] if writing fails.
    pub fn new(
        out: W,
        path: impl AsRef<Path>,
        metadata: &[(String, GgufValue)],
        tensors: Vec<TensorPlan>,
    ) -> Result<Self> {
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            Some((_, v)) => match v.as_u64() {
                Some(a) if a.is_power_of_two() && a < 1 << 16 => a,
                _ => {
                    return Err(LlamaError::InvalidFormat(format!(
                        "general.alignment = {v} is not a power of two below 65536"
                    )));
                }
            },
            None => DEFAULT_ALIGNMENT,
        };
        let mut names = std::collections::HashSet::new();
        let mut sized = Vec::with_capacity(tensors.len());
        for t in tensors {
            if t.shape.len() > MAX_DIMS || !names.insert(t.name.clone()) {
                return Err(LlamaError::InvalidFormat(format!(
                    "tensor `{}` of shape {:?}: more than {MAX_DIMS} dimensions, or a name used twice",
                    t.name, t.shape
                )));
            }
            let n = t.n_bytes()?;
            sized.push((t, n));
        }

        let mut head = Vec::new();
        head.extend_from_slice(&GGUF_MAGIC);
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(sized.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in metadata {
            put_string(&mut head, key);
            head.extend_from_slice(&value_type(value)?.to_le_bytes());
            put_value(&mut head, value)?;
        }
        let mut offset = 0u64;
        for (t, n) in &sized {
            put_string(&mut head, &t.name);
            head.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for &d in t.shape.iter().rev() {
                head.extend_from_slice(&(d as u64).to_le_bytes());
            }
            head.extend_from_slice(&t.ty.id().to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offset = offset
                .checked_add(*n)
                .map(|end| end.next_multiple_of(alignment))
                .ok_or_else(|| LlamaError::InvalidFormat("tensor data too large".into()))?;
        }
        let padded = (head.len() as u64).next_multiple_of(alignment);
        head.resize(padded as usize, 0);

        let mut writer = GgufWriter {
            out,
            path: path.as_ref().to_path_buf(),
            tensors: sized,
            alignment,
            position: 0,
            current: 0,
            done: 0,
        };
        writer.put(&head)?;
        writer.skip_empty();
        Ok(writer)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.out
            .write_all(bytes)
            .map_err(|e| LlamaError::io(&self.path, e))?;
        self.position += bytes.len() as u64;
        Ok(())
    }

    /// Moves past tensors with no data.
    fn skip_empty(&mut self) {
        while self.tensors.get(self.current).is_some_and(|t| t.1 == 0) {
            self.current += 1;
        }
    }

    /// The tensor the next [`write`](Self::write) continues, if any is left.
    pub fn next_tensor(&self) -> Option<&TensorPlan> {
        self.tensors.get(self.current).map(|t| &t.0)
    }

    /// Appends `bytes` to the tensor being written (tensors are written in the order
    /// they were declared); when a tensor is complete, the padding to the next one is
    /// written and the next one begins. A piece may not run past the end of its tensor.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidFormat`] if every tensor is already complete or `bytes` runs
    /// past the current one; [`LlamaError::Io`] if writing fails.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let Some((plan, total)) = self.tensors.get(self.current) else {
            return Err(LlamaError::InvalidFormat(format!(
                "{} bytes of tensor data after the last tensor",
                bytes.len()
            )));
        };
        let total = *total;
        if self.done + bytes.len() as u64 > total {
            return Err(LlamaError::InvalidFormat(format!(
                "tensor `{}` takes {total} bytes; {} more after {} is too many",
                plan.name,
                bytes.len(),
                self.done
            )));
        }
        self.put(bytes)?;
        self.done += bytes.len() as u64;
        if self.done == total {
            let pad = self.position.next_multiple_of(self.alignment) - self.position;
            self.put(&vec![0u8; pad as usize])?;
            self.current += 1;
            self.done = 0;
            self.skip_empty();
        }
        Ok(())
    }

    /// Checks that every tensor was written whole, flushes, and returns the output.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidFormat`] naming the first tensor not written whole;
    /// [`LlamaError::Io`] if flushing fails.
    pub fn finish(mut self) -> Result<W> {
        if let Some(t) = self.next_tensor() {
            return Err(LlamaError::InvalidFormat(format!(
                "tensor `{}` was not written whole ({} of {} bytes)",
                t.name, self.done, self.tensors[self.current].1
            )));
        }
        self.out
            .flush()
            .map_err(|e| LlamaError::io(&self.path, e))?;
        Ok(self.out)
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// The GGUF type id of a value.
fn value_type(v: &GgufValue) -> Result<u32> {
    Ok(match v {
        GgufValue::U8(_) => 0,
        GgufValue::I8(_) => 1,
        GgufValue::U16(_) => 2,
        GgufValue::I16(_) => 3,
        GgufValue::U32(_) => 4,
        GgufValue::I32(_) => 5,
        GgufValue::F32(_) => 6,
        GgufValue::Bool(_) => 7,
        GgufValue::String(_) => 8,
        GgufValue::Array(_) => 9,
        GgufValue::U64(_) => 10,
        GgufValue::I64(_) => 11,
        GgufValue::F64(_) => 12,
    })
}

/// A value's bytes (without its type id). An array holds its element type, its length
/// and its elements; an empty array is written as one of `u8`.
fn put_value(out: &mut Vec<u8>, v: &GgufValue) -> Result<()> {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(u8::from(*x)),
        GgufValue::String(s) => put_string(out, s),
        GgufValue::Array(items) => {
            let ty = items.first().map_or(Ok(0), value_type)?;
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                if value_type(item)? != ty {
                    return Err(LlamaError::InvalidFormat(format!(
                        "a metadata array mixes {} and {} elements",
                        items[0].type_name(),
                        item.type_name()
                    )));
                }
                put_value(out, item)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;
    use crate::loader::gguf::GgufFile;

    fn meta() -> Vec<(String, GgufValue)> {
        vec![
            (
                "general.architecture".into(),
                GgufValue::String("llama".into()),
            ),
            ("a.u32".into(), GgufValue::U32(7)),
            ("a.f64".into(), GgufValue::F64(0.25)),
            ("a.bool".into(), GgufValue::Bool(true)),
            (
                "a.strings".into(),
                GgufValue::Array(vec![
                    GgufValue::String("x".into()),
                    GgufValue::String("yz".into()),
                ]),
            ),
            (
                "a.nested".into(),
                GgufValue::Array(vec![GgufValue::Array(vec![GgufValue::I16(-3)])]),
            ),
        ]
    }

    #[test]
    fn written_files_read_back() {
        let dir = std::env::temp_dir().join(format!("gguf-writer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.gguf");
        let plans = vec![
            TensorPlan::new("v", &[3], GgmlType::F32),
            TensorPlan::new("m", &[2, 32], GgmlType::Q8_0),
        ];
        let mut w = GgufWriter::create(&path, &meta(), plans).unwrap();
        assert_eq!(w.next_tensor().map(|t| t.name.as_str()), Some("v"));
        w.write(&1f32.to_le_bytes()).unwrap();
        w.write(&[2f32.to_le_bytes(), 3f32.to_le_bytes()].concat())
            .unwrap();
        let block: Vec<u8> = (0..68u8).collect();
        // Past the end of the tensor: refused.
        assert_err!(
            w.write(&[block.clone(), vec![0]].concat()),
            LlamaError::InvalidFormat(m) if m.contains("tensor `m` takes 68 bytes; 69 more")
        );
        w.write(&block[..10]).unwrap();
        w.write(&block[10..]).unwrap();
        assert_err!(
            w.write(&[0]),
            LlamaError::InvalidFormat(m) if m.contains("after the last tensor")
        );
        w.finish().unwrap();

        let f = GgufFile::open(&path).unwrap();
        for (k, v) in meta() {
            assert_eq!(f.get(&k), Some(&v), "{k}");
        }
        assert_eq!(f.read_tensor_f32("v").unwrap(), (vec![3], vec![1., 2., 3.]));
        let info = f.tensor_info("m").unwrap().clone();
        assert_eq!(info.shape(), vec![2, 32]);
        assert_eq!(info.offset % 32, 0);
        assert_eq!(f.read_tensor_bytes(&info).unwrap(), block);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_plans_and_short_data_are_errors() {
        let sink = Vec::new();
        let q = |shape: &[usize]| vec![TensorPlan::new("q", shape, GgmlType::Q4_K)];
        assert_err!(
            GgufWriter::new(sink.clone(), "x", &[], q(&[2, 128])),
            LlamaError::InvalidFormat(m) if m.contains("rows are not a whole number")
        );
        // Both refusals share a message; the shape in it tells which tensor fired.
        assert_err!(
            GgufWriter::new(sink.clone(), "x", &[], q(&[1, 1, 1, 1, 256])),
            LlamaError::InvalidFormat(m) if m.contains("[1, 1, 1, 1, 256]: more than 4 dimensions")
        );
        let twice = [q(&[256]), q(&[256])].concat();
        assert_err!(
            GgufWriter::new(sink.clone(), "x", &[], twice),
            LlamaError::InvalidFormat(m) if m.contains("`q` of shape [256]: more than 4 dimensions, or a name used twice")
        );
        let mixed = vec![(
            "k".to_string(),
            GgufValue::Array(vec![GgufValue::U8(1), GgufValue::I8(1)]),
        )];
        assert_err!(
            GgufWriter::new(sink.clone(), "x", &mixed, vec![]),
            LlamaError::InvalidFormat(m) if m.contains("mixes")
        );
        let align = vec![("general.alignment".to_string(), GgufValue::U32(3))];
        assert_err!(
            GgufWriter::new(sink.clone(), "x", &align, vec![]),
            LlamaError::InvalidFormat(m) if m.contains("general.alignment = 3")
        );
        let mut w = GgufWriter::new(sink, "x", &[], q(&[256])).unwrap();
        w.write(&[0; 100]).unwrap();
        assert_err!(
            w.finish(),
            LlamaError::InvalidFormat(m) if m.contains("`q` was not written whole (100 of 144 bytes)")
        );
    }
}
