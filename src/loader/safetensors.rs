//! Hugging Face checkpoints: `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. Files are memory-mapped; F32, F16 and BF16 tensors are
//! converted to f32.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensorError, SafeTensors};

use super::TensorSource;
use crate::error::{LlamaError, Result};

/// A set of memory-mapped safetensors files.
pub struct SafetensorsSource {
    maps: Vec<Mmap>,
    /// Tensor name -> index into `maps`.
    index: HashMap<String, usize>,
    paths: Vec<PathBuf>,
}

fn format_error(path: &Path, e: impl std::fmt::Display) -> LlamaError {
    LlamaError::InvalidFormat(format!("{}: {e}", path.display()))
}

/// Maps a safetensors parsing error: a file shorter than its header describes is
/// `Truncated`, anything else `InvalidFormat`.
fn parse_error(path: &Path, file_len: usize, e: SafeTensorError) -> LlamaError {
    let msg = format!("{}: {e}", path.display());
    let cut_short = match &e {
        SafeTensorError::HeaderTooSmall => true,
        SafeTensorError::InvalidHeaderLength => {
            // The 8-byte length prefix points past the end of the file.
            file_len >= 8
        }
        // Also raised for trailing bytes; only a short buffer means truncation.
        SafeTensorError::MetadataIncompleteBuffer => true,
        _ => false,
    };
    if cut_short {
        LlamaError::Truncated(msg)
    } else {
        LlamaError::InvalidFormat(msg)
    }
}

/// `dir/name` for a shard named in an index's `weight_map`, refused unless `name` is a
/// relative path that stays inside `dir` (no `..`, no root, no drive prefix): a
/// downloaded index must not make the loader open files elsewhere.
fn shard_path(dir: &Path, name: &str, index_path: &Path) -> Result<PathBuf> {
    let rel = Path::new(name);
    let inside = !name.is_empty()
        && rel
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
    if inside {
        Ok(dir.join(rel))
    } else {
        Err(format_error(
            index_path,
            format!("weight_map names the file `{name}`, outside the model directory"),
        ))
    }
}

impl SafetensorsSource {
    /// Opens the checkpoint in a Hugging Face model directory: the index file if present,
    /// else `model.safetensors`.
    pub fn open_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let index_path = dir.join("model.safetensors.index.json");
        if index_path.is_file() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| LlamaError::io(&index_path, e))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format_error(&index_path, e))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| format_error(&index_path, "no weight_map"))?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(String::from))
                .collect();
            files.sort();
            files.dedup();
            let paths = files
                .iter()
                .map(|f| shard_path(dir, f, &index_path))
                .collect::<Result<Vec<_>>>()?;
            return Self::open_files(&paths);
        }
        Self::open_files(&[dir.join("model.safetensors")])
    }

    /// Opens the given safetensors files as one checkpoint.
    pub fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut maps = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file = std::fs::File::open(path).map_err(|e| LlamaError::io(path, e))?;
            // SAFETY: the map is read-only; we rely on the checkpoint not being modified
            // while it is loaded, as every memory-mapping loader does.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| LlamaError::io(path, e))?;
            let tensors =
                SafeTensors::deserialize(&map).map_err(|e| parse_error(path, map.len(), e))?;
            for name in tensors.names() {
                index.insert(name.to_string(), i);
            }
            maps.push(map);
        }
        Ok(Self {
            maps,
            index,
            paths: paths.to_vec(),
        })
    }
}

impl SafetensorsSource {
    /// Every tensor's name and shape as the headers declare them (nothing is read or
    /// converted), sorted by name.
    ///
    /// # Errors
    ///
    /// What parsing a header reports (the files were parsed once already on opening).
    pub fn shapes(&self) -> Result<Vec<(String, Vec<usize>)>> {
        let mut out = Vec::with_capacity(self.index.len());
        for (path, map) in self.paths.iter().zip(&self.maps) {
            let tensors =
                SafeTensors::deserialize(map).map_err(|e| parse_error(path, map.len(), e))?;
            for (name, view) in tensors.tensors() {
                out.push((name, view.shape().to_vec()));
            }
        }
        out.sort();
        Ok(out)
    }
}

impl TensorSource for SafetensorsSource {
    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn read(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let &file = self
            .index
            .get(name)
            .ok_or_else(|| LlamaError::MissingTensor(name.to_string()))?;
        let path = &self.paths[file];
        let tensors = SafeTensors::deserialize(&self.maps[file])
            .map_err(|e| parse_error(path, self.maps[file].len(), e))?;
        let view = tensors.tensor(name).map_err(|e| format_error(path, e))?;
        let bytes = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(LlamaError::UnsupportedTensorType {
                    name: name.to_string(),
                    ty: format!("{other:?}"),
                });
            }
        };
        Ok((view.shape().to_vec(), data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_files_are_truncated_and_foreign_files_invalid() {
        let data: Vec<u8> = (0..64u32).flat_map(|x| (x as f32).to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![8, 8], &data).unwrap();
        let bytes = safetensors::serialize([("w", view)], None).unwrap();
        let dir = std::env::temp_dir().join(format!("llama-burn-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.safetensors");
        for (cut, truncated) in [(bytes.len() - 1, true), (20, true), (4, true)] {
            std::fs::write(&path, &bytes[..cut]).unwrap();
            let err = SafetensorsSource::open_files(std::slice::from_ref(&path))
                .err()
                .unwrap();
            assert_eq!(
                matches!(err, LlamaError::Truncated(_)),
                truncated,
                "cut at {cut}: {err}"
            );
        }
        std::fs::write(&path, b"this is plainly not a safetensors file at all").unwrap();
        let err = SafetensorsSource::open_files(std::slice::from_ref(&path))
            .err()
            .unwrap();
        assert!(
            matches!(err, LlamaError::InvalidFormat(_) | LlamaError::Truncated(_)),
            "{err}"
        );
        std::fs::write(&path, &bytes).unwrap();
        let mut ok = SafetensorsSource::open_files(std::slice::from_ref(&path)).unwrap();
        assert_eq!(ok.read("w").unwrap().0, vec![8, 8]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_index_naming_files_outside_the_directory_is_refused() {
        let dir = std::env::temp_dir().join(format!("llama-burn-st-index-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for shard in [
            "../model.safetensors",
            "sub/../../x.safetensors",
            "/etc/passwd",
            "",
        ] {
            let index = serde_json::json!({ "weight_map": { "w": shard } });
            std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
            let err = SafetensorsSource::open_dir(&dir).err().unwrap();
            assert!(
                matches!(&err, LlamaError::InvalidFormat(m) if m.contains("outside the model directory")),
                "{shard}: {err}"
            );
        }
        // A shard in a subdirectory is fine (it is then simply missing here).
        let index = serde_json::json!({ "weight_map": { "w": "shards/a.safetensors" } });
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        assert!(matches!(
            SafetensorsSource::open_dir(&dir).err().unwrap(),
            LlamaError::Io { .. }
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
