//! Embedding lookup: rows of a table scaled by a constant (EmbeddingGemma's √hidden).
//! CUDA form: `embedding.cu`, launched from [`crate::kernels::cuda_ops`].

pub mod cuda;

use crate::error::{Error, Result};
use crate::formats::Tensor;

/// The table's rows `ids[r]`, each times `scale`, [ids][width]. An id outside the table is an
/// input error (never an out-of-bounds read).
pub fn embed_lookup(table: &Tensor, ids: &[u32], scale: f32) -> Result<Vec<f32>> {
    let (rows, width) = match table.shape[..] {
        [r, w] => (r, w),
        _ => return Err(Error::Shape(format!("embedding table {}: shape {:?} is not 2-D", table.name, table.shape))),
    };
    check_ids(ids, rows)?;
    let data = table.data();
    let mut out = Vec::with_capacity(ids.len() * width);
    for &id in ids {
        out.extend(data[id as usize * width..(id as usize + 1) * width].iter().map(|&e| e * scale));
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
