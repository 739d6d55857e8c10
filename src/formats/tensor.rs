//! A named f32 tensor whose storage is either a view into a memory-mapped weight file (zero-copy,
//! pages read on first touch) or an owned buffer decoded from another dtype.

use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Error, Result};

#[derive(Clone)]
enum Storage {
    /// `len` f32 values at byte `offset` of the map; the offset is 4-byte aligned (checked).
    Mapped { map: Arc<Mmap>, offset: usize, len: usize },
    /// Shared, so that a clone (a tied embedding used as the head too) costs no copy.
    Owned(Arc<Vec<f32>>),
}

#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    storage: Storage,
}

impl Tensor {
    pub fn owned(name: impl Into<String>, shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor { name: name.into(), shape, storage: Storage::Owned(Arc::new(data)) }
    }

    /// A zero-copy view; the caller guarantees `offset + 4·len` lies inside the map.
    pub(crate) fn mapped(name: String, shape: Vec<usize>, map: Arc<Mmap>, offset: usize) -> Tensor {
        let len = shape.iter().product();
        debug_assert!(offset % 4 == 0 && offset + 4 * len <= map.len());
        Tensor { name, shape, storage: Storage::Mapped { map, offset, len } }
    }

    pub fn data(&self) -> &[f32] {
        match &self.storage {
            Storage::Owned(v) => v,
            Storage::Mapped { map, offset, len } => {
                // SAFETY: alignment and bounds were checked when the view was made; the map is
                // read-only and lives as long as `self`.
                unsafe { std::slice::from_raw_parts(map.as_ptr().add(*offset) as *const f32, *len) }
            }
        }
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped { .. })
    }

    /// Checks the shape against what the model's config implies; the error names the tensor.
    pub fn expect_shape(self, shape: &[usize]) -> Result<Tensor> {
        if self.shape != shape {
            return Err(Error::tensor(
                &self.name,
                format!("has shape {:?}, the config implies {:?}", self.shape, shape),
            ));
        }
        Ok(self)
    }

    /// Matrices of equal width stacked row-wise into one (an owned copy): the weights of
    /// projections that read the same input, so that one GEMM computes them all.
    pub fn concat_rows(name: impl Into<String>, parts: &[Tensor]) -> Result<Tensor> {
        let name = name.into();
        let cols = match parts.first().map(|t| &t.shape[..]) {
            Some([_, c]) => *c,
            _ => return Err(Error::tensor(&name, "concatenation needs matrices")),
        };
        let mut rows = 0;
        let mut data = Vec::with_capacity(parts.iter().map(|t| t.len()).sum());
        for t in parts {
            match t.shape[..] {
                [r, c] if c == cols => rows += r,
                _ => return Err(Error::tensor(&t.name, format!("shape {:?} cannot stack under rows of {cols}", t.shape))),
            }
            data.extend_from_slice(t.data());
        }
        Ok(Tensor::owned(name, vec![rows, cols], data))
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({}, {:?}, {})", self.name, self.shape, if self.is_mapped() { "mapped" } else { "owned" })
    }
}

/// A bf16 tensor kept as stored: a zero-copy view of `len` little-endian bf16 values at byte
/// `offset` of a memory-mapped file (2-byte aligned, checked when made).
#[derive(Clone)]
pub struct Bf16Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    map: Arc<Mmap>,
    offset: usize,
}

impl Bf16Tensor {
    /// A view of `shape` at `offset`, or None when the bytes are out of the map or misaligned
    /// (the caller then decodes instead).
    pub(crate) fn mapped(name: String, shape: Vec<usize>, map: Arc<Mmap>, offset: usize) -> Option<Bf16Tensor> {
        let len: usize = shape.iter().product();
        let fits = offset.checked_add(2 * len).is_some_and(|end| end <= map.len());
        let aligned = (map.as_ptr() as usize + offset).is_multiple_of(2);
        (fits && aligned && cfg!(target_endian = "little")).then_some(Bf16Tensor { name, shape, map, offset })
    }

    /// The raw bf16 bits; widening one to f32 is `f32::from_bits((b as u32) << 16)`.
    pub fn data(&self) -> &[u16] {
        let len = self.shape.iter().product();
        // SAFETY: bounds and alignment were checked when the view was made; the map is read-only
        // and lives as long as `self`; the host is little-endian, as the file is.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(self.offset) as *const u16, len) }
    }
}

/// Q8_0 blocks kept as stored: a zero-copy view of the 34-byte blocks (f16 scale, 32 i8 quants)
/// of a [rows][cols] matrix whose rows are whole blocks.
#[derive(Clone)]
pub struct Q8Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    map: Arc<Mmap>,
    offset: usize,
}

impl Q8Tensor {
    /// A view of `shape` at `offset`, or None when the rows are not whole blocks or the bytes
    /// are out of the map (the caller then decodes instead).
    pub(crate) fn mapped(name: String, shape: Vec<usize>, map: Arc<Mmap>, offset: usize) -> Option<Q8Tensor> {
        let cols = *shape.last()?;
        let len: usize = shape.iter().product();
        let fits = offset.checked_add(len / 32 * 34).is_some_and(|end| end <= map.len());
        (cols % 32 == 0 && fits).then_some(Q8Tensor { name, shape, map, offset })
    }

    /// The raw blocks.
    pub fn data(&self) -> &[u8] {
        let len: usize = self.shape.iter().product();
        &self.map[self.offset..self.offset + len / 32 * 34]
    }
}

/// A weight matrix as a model keeps it: f32 (mapped or decoded), or bf16 or Q8_0 as stored.
#[derive(Clone)]
pub enum Matrix {
    F32(Tensor),
    Bf16(Bf16Tensor),
    Q8_0(Q8Tensor),
}

impl Matrix {
    pub fn name(&self) -> &str {
        match self {
            Matrix::F32(t) => &t.name,
            Matrix::Bf16(t) => &t.name,
            Matrix::Q8_0(t) => &t.name,
        }
    }

    pub fn shape(&self) -> &[usize] {
        match self {
            Matrix::F32(t) => &t.shape,
            Matrix::Bf16(t) => &t.shape,
            Matrix::Q8_0(t) => &t.shape,
        }
    }

    /// Checks the shape against what the model's config implies; the error names the tensor.
    pub fn expect_shape(self, shape: &[usize]) -> Result<Matrix> {
        if self.shape() != shape {
            return Err(Error::tensor(
                self.name(),
                format!("has shape {:?}, the config implies {:?}", self.shape(), shape),
            ));
        }
        Ok(self)
    }
}

impl From<Tensor> for Matrix {
    fn from(t: Tensor) -> Matrix {
        Matrix::F32(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concat_rows_stacks_matrices_of_one_width() {
        let a = Tensor::owned("a", vec![1, 2], vec![1.0, 2.0]);
        let b = Tensor::owned("b", vec![2, 2], vec![3.0, 4.0, 5.0, 6.0]);
        let c = Tensor::concat_rows("ab", &[a, b]).unwrap();
        assert_eq!((c.shape.clone(), c.data().to_vec()), (vec![3, 2], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
        let wide = Tensor::owned("w", vec![1, 3], vec![0.0; 3]);
        let err = Tensor::concat_rows("x", &[c, wide]).unwrap_err().to_string();
        assert!(err.contains("`w`") && err.contains("rows of 2"), "{err}");
    }
}
