//! Safetensors weights, one file or a sharded set (`model.safetensors.index.json`), memory-mapped.
//! F32 tensors are returned as zero-copy views into the map; BF16 and F16 are decoded to f32 on
//! load (the numerics contract keeps every activation in f32), except the weight matrices a model
//! asks for with [`SafetensorsWeights::load_matrix`]: BF16 ones stay bf16 views, which the
//! products widen exactly (a bf16 checkpoint's matrices would otherwise take twice their bytes).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, TensorInfo};

use super::{Bf16Tensor, Matrix, Tensor};
use crate::error::{Error, Result};

struct Shard {
    path: PathBuf,
    map: Arc<Mmap>,
    /// Byte offset of the data section (after the 8-byte length and the JSON header).
    data_start: usize,
}

/// The tensors of a checkpoint, by name, across its shards.
pub struct SafetensorsWeights {
    shards: Vec<Shard>,
    index: HashMap<String, (usize, TensorInfo)>,
}

impl SafetensorsWeights {
    /// Opens `dir/model.safetensors`, or the shards named by `dir/model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        if single.is_file() {
            Self::open_files(&[single])
        } else if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Error::format(&index, e.to_string()))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::format(&index, "no `weight_map` object"))?;
            let mut files: Vec<PathBuf> = Vec::new();
            for v in map.values() {
                let f = v.as_str().ok_or_else(|| Error::format(&index, "a `weight_map` value is not a string"))?;
                let p = dir.join(f);
                if !files.contains(&p) {
                    files.push(p);
                }
            }
            files.sort();
            Self::open_files(&files)
        } else {
            Err(Error::format(dir, "no model.safetensors or model.safetensors.index.json"))
        }
    }

    pub fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file = File::open(path).map_err(|e| Error::io(path, e))?;
            // SAFETY: the map is read-only; a file truncated under us by another process is the
            // one hazard of every memory-mapped reader and is outside what we can guard against.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
            let (header_len, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| Error::format(path, format!("not a valid safetensors file ({e})")))?;
            for (name, info) in meta.tensors() {
                if index.insert(name.clone(), (i, info.clone())).is_some() {
                    return Err(Error::format(path, format!("tensor `{name}` appears in two shards")));
                }
            }
            shards.push(Shard { path: path.clone(), map: Arc::new(map), data_start: 8 + header_len });
        }
        Ok(SafetensorsWeights { shards, index })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(|s| s.as_str())
    }

    /// The stored dtype of a tensor, for reporting.
    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        self.index.get(name).map(|(_, info)| info.dtype)
    }

    /// The tensor as f32, with its shape checked against `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.load(name)?.expect_shape(shape)
    }

    /// A weight matrix for the products: BF16 stays as stored (a zero-copy view), every other
    /// dtype as [`Self::get`] gives it; the shape is checked against `shape`.
    pub fn load_matrix(&self, name: &str, shape: &[usize]) -> Result<Matrix> {
        let (shard_idx, info) =
            self.index.get(name).ok_or_else(|| Error::tensor(name, "missing from the checkpoint"))?;
        if info.dtype == Dtype::BF16 {
            let shard = &self.shards[*shard_idx];
            let (begin, end) = info.data_offsets;
            let whole = end - begin == 2 * info.shape.iter().product::<usize>();
            let view = Bf16Tensor::mapped(name.to_string(), info.shape.clone(), shard.map.clone(), shard.data_start + begin);
            if let (true, Some(t)) = (whole, view) {
                return Matrix::Bf16(t).expect_shape(shape);
            }
        }
        Ok(Matrix::F32(self.get(name, shape)?))
    }

    pub fn load(&self, name: &str) -> Result<Tensor> {
        let (shard_idx, info) =
            self.index.get(name).ok_or_else(|| Error::tensor(name, "missing from the checkpoint"))?;
        let shard = &self.shards[*shard_idx];
        let (begin, end) = info.data_offsets;
        let bytes = &shard.map[shard.data_start + begin..shard.data_start + end];
        let n: usize = info.shape.iter().product();
        let shape = info.shape.clone();
        let decode = |size: usize, f: &dyn Fn(&[u8]) -> f32| -> Result<Tensor> {
            if bytes.len() != n * size {
                return Err(Error::tensor(name, format!("{} bytes for {n} elements", bytes.len())));
            }
            Ok(Tensor::owned(name, shape.clone(), bytes.chunks_exact(size).map(f).collect()))
        };
        match info.dtype {
            Dtype::F32 => {
                let offset = shard.data_start + begin;
                if (shard.map.as_ptr() as usize + offset) % 4 == 0 {
                    Ok(Tensor::mapped(name.to_string(), shape, shard.map.clone(), offset))
                } else {
                    decode(4, &|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                }
            }
            Dtype::BF16 => decode(2, &|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            Dtype::F16 => decode(2, &|b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
            other => Err(Error::tensor(
                name,
                format!("dtype {other:?} in {} is not supported (F32, BF16, F16 are)", shard.path.display()),
            )),
        }
    }
}
