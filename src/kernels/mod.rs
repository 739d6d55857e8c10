//! The op set. One folder per kernel family; each entry point validates shapes before it
//! computes, so that a model bug surfaces as a named shape error rather than a wrong answer.
//! The CPU forms here are the reference for every other backend.

pub mod activation;
pub mod attention;
pub mod backend;
pub mod cuda_ops;
#[cfg(test)]
mod cuda_tests;
pub mod embedding;
pub mod gated_delta;
pub mod matmul;
pub mod moe;
pub mod norm;
pub mod pool;
pub mod rope;
pub mod sample;

use crate::error::{Error, Result};

/// A sequence inside a packed batch: rows `start .. start + len` of every activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub start: usize,
    pub len: usize,
}

/// Segments laid end to end for the given lengths.
pub fn pack(lengths: impl IntoIterator<Item = usize>) -> Vec<Segment> {
    let mut start = 0;
    lengths
        .into_iter()
        .map(|len| {
            let s = Segment { start, len };
            start += len;
            s
        })
        .collect()
}

pub(crate) fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::Shape(format!("{what}: {got} elements, expected {want}")));
    }
    Ok(())
}

pub(crate) fn check_at_least(what: &str, got: usize, want: usize) -> Result<()> {
    if got < want {
        return Err(Error::Shape(format!("{what}: {got} elements, at least {want} needed")));
    }
    Ok(())
}

/// A raw pointer that rayon tasks may share when each task writes a disjoint region.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(pub *mut f32);
// SAFETY: only used by kernels whose tasks write provably disjoint index ranges.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    /// Going through a method makes closures capture the wrapper, not the bare pointer.
    pub(crate) fn ptr(self) -> *mut f32 {
        self.0
    }
}
