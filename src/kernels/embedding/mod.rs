//! Embedding lookup: rows of a table scaled by a constant (EmbeddingGemma's √hidden).
//! CUDA form: `embedding.cu`, launched from [`crate::kernels::cuda_ops`].

pub mod cuda;

use crate::error::{Error, Result};
use crate::formats::Matrix;
use crate::kernels::matmul::Weights;

/// The table's rows `ids[r]` (decoded to f32 from the stored dtype), each times `scale`,
/// [ids][width]. An id outside the table is an input error (never an out-of-bounds read).
pub fn embed_lookup(table: &Matrix, ids: &[u32], scale: f32) -> Result<Vec<f32>> {
    let (rows, width) = match table.shape()[..] {
        [r, w] => (r, w),
        _ => return Err(Error::Shape(format!("embedding table {}: shape {:?} is not 2-D", table.name(), table.shape()))),
    };
    check_ids(ids, rows)?;
    let w = Weights::from(table);
    let mut out = vec![0.0f32; ids.len() * width];
    for (&id, row) in ids.iter().zip(out.chunks_mut(width.max(1))) {
        w.row_into(id as usize, width, row)?;
        if scale != 1.0 {
            row.iter_mut().for_each(|e| *e *= scale);
        }
    }
    Ok(out)
}

/// Every id must index a row of a table of `rows` rows.
pub fn check_ids(ids: &[u32], rows: usize) -> Result<()> {
    match ids.iter().find(|&&id| id as usize >= rows) {
        Some(id) => Err(Error::Input(format!("token id {id} is outside the vocabulary of {rows}"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_scales_rows_and_refuses_ids_outside_the_table() {
        let t = Matrix::F32(crate::formats::Tensor::owned("t", vec![3, 2], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
        assert_eq!(embed_lookup(&t, &[2, 0, 2], 0.5).unwrap(), vec![2.5, 3.0, 0.5, 1.0, 2.5, 3.0]);
        match embed_lookup(&t, &[1, 3], 1.0) {
            Err(Error::Input(m)) => assert!(m.contains("token id 3") && m.contains("vocabulary of 3"), "{m}"),
            other => panic!("expected an input error, got {other:?}"),
        }
    }
}
