//! Sequence pooling and vector normalisation.

pub mod cuda;

use super::{check_len, Segment};
use crate::error::{Error, Result};

/// out[s] = mean of the rows of sequence s (every token counts: BOS, prompt and EOS included).
/// Sums run in f64 so that the mean does not depend on the sequence's length in rounding.
pub fn mean_pool(h: &[f32], d: usize, segments: &[Segment]) -> Result<Vec<f32>> {
    let rows: usize = segments.last().map(|s| s.start + s.len).unwrap_or(0);
    check_len("mean_pool input", h.len(), rows * d)?;
    let mut out = vec![0.0f32; segments.len() * d];
    let mut acc = vec![0.0f64; d];
    for (s, seg) in segments.iter().enumerate() {
        if seg.len == 0 {
            return Err(Error::Shape(format!("mean_pool: sequence {s} is empty")));
        }
        acc.fill(0.0);
        for row in h[seg.start * d..(seg.start + seg.len) * d].chunks(d) {
            acc.iter_mut().zip(row).for_each(|(a, &v)| *a += v as f64);
        }
        for (o, a) in out[s * d..(s + 1) * d].iter_mut().zip(&acc) {
            *o = (a / seg.len as f64) as f32;
        }
    }
    Ok(out)
}

/// x ← x / max(‖x‖₂, 1e-12) per row, as `torch.nn.functional.normalize`.
pub fn l2_normalize(x: &mut [f32], d: usize) -> Result<()> {
    if d == 0 || x.len() % d != 0 {
        return Err(Error::Shape(format!("l2_normalize: {} elements are not rows of {d}", x.len())));
    }
    for row in x.chunks_mut(d) {
        let n = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>().sqrt().max(1e-12);
        row.iter_mut().for_each(|v| *v = (*v as f64 / n) as f32);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::pack;

    #[test]
    fn mean_pool_and_normalize() {
        let h = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let p = mean_pool(&h, 2, &pack([2, 1])).unwrap();
        assert_eq!(p, vec![2.0, 3.0, 5.0, 6.0]);
        let mut x = vec![3.0f32, 4.0, 0.0, 0.0];
        l2_normalize(&mut x, 2).unwrap();
        assert_eq!(x, vec![0.6, 0.8, 0.0, 0.0]);
        assert!(mean_pool(&h, 2, &pack([2, 0])).is_err());
    }
}
