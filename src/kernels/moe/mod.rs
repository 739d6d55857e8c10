//! Mixture-of-experts routing and the routed experts' mix (Qwen3.5 MoE): the router's logits
//! go through a softmax in f32, the top-k experts of each row are kept and their weights
//! renormalised to sum to one, and each row gets Σ weight·down(silu(gate·x)·up·x).
//! CUDA form: `cuda.rs` beside this file (the routing is this module's [`route`]).

pub mod cuda;

use crate::error::{Error, Result};
use crate::formats::Matrix;
use crate::kernels::activation::silu_mul;
use crate::kernels::backend::matrix_shape;
use crate::kernels::check_len;
use crate::kernels::matmul::linear_w;

/// One expert's gated SiLU MLP on the host.
pub struct Expert {
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
    /// Intermediate width.
    pub width: usize,
    pub hidden: usize,
}

/// The (intermediate width, hidden size) of a gated MLP's gate, up and down matrices
/// ([width][hidden] twice, then [hidden][width]), or an error naming its down matrix.
pub fn mlp_shape([gate, up, down]: &[Matrix; 3]) -> Result<(usize, usize)> {
    let (width, hidden) = matrix_shape(gate)?;
    if matrix_shape(up)? != (width, hidden) || matrix_shape(down)? != (hidden, width) {
        return Err(Error::tensor(down.name(), format!("expert matrices do not fit a {hidden} → {width} → {hidden} MLP")));
    }
    Ok((width, hidden))
}

impl Expert {
    pub fn new(matrices: [Matrix; 3]) -> Result<Expert> {
        let (width, hidden) = mlp_shape(&matrices)?;
        let [gate, up, down] = matrices;
        Ok(Expert { gate, up, down, width, hidden })
    }

    /// down(silu(gate·x)·up·x) over `rows` rows.
    pub fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        let mut g = linear_w(x, rows, (&self.gate).into(), self.width, self.hidden)?;
        let u = linear_w(x, rows, (&self.up).into(), self.width, self.hidden)?;
        silu_mul(&mut g, &u)?;
        linear_w(&g, rows, (&self.down).into(), self.hidden, self.width)
    }
}

/// Per expert, the rows routed to it and their renormalised weights, rows in ascending order.
pub fn route(logits: &[f32], experts: usize, top_k: usize) -> Result<Vec<Vec<(usize, f32)>>> {
    if experts == 0 || top_k == 0 || top_k > experts || logits.len() % experts != 0 {
        return Err(Error::Shape(format!("moe routing: top-{top_k} of {experts} experts over {} logits", logits.len())));
    }
    let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts];
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for (t, row) in logits.chunks(experts).enumerate() {
        let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = row.iter().map(|&v| (v - mx).exp()).collect();
        let total: f32 = e.iter().sum();
        let probs: Vec<f32> = e.iter().map(|&v| v / total).collect();
        order.clear();
        order.extend(0..experts);
        // Highest probability first; ties keep the lower expert index, as torch.topk does.
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        let top = &order[..top_k];
        let sum: f32 = top.iter().map(|&i| probs[i]).sum();
        for &i in top {
            routed[i].push((t, probs[i] / sum));
        }
    }
    Ok(routed)
}

/// The routed mix for each row of `x` (rows of `d`): experts in index order, each adding
/// weight·output to its rows (the order the CUDA form adds in too).
pub fn moe_experts(x: &[f32], d: usize, logits: &[f32], experts: &[Expert], top_k: usize) -> Result<Vec<f32>> {
    let ne = experts.len();
    if d == 0 || x.len() % d != 0 {
        return Err(Error::Shape(format!("moe input: {} elements are not rows of {d}", x.len())));
    }
    let rows = x.len() / d;
    check_len("moe router logits", logits.len(), rows * ne)?;
    if let Some(e) = experts.iter().find(|e| e.hidden != d) {
        return Err(Error::tensor(e.gate.name(), format!("expert of width {} on rows of {d}", e.hidden)));
    }
    let routed = route(logits, ne, top_k)?;
    let mut out = vec![0.0f32; rows * d];
    for (expert, tokens) in experts.iter().zip(&routed) {
        if tokens.is_empty() {
            continue;
        }
        let gathered: Vec<f32> = tokens.iter().flat_map(|&(t, _)| x[t * d..(t + 1) * d].iter().copied()).collect();
        let y = expert.forward(&gathered, tokens.len())?;
        for (row, &(t, w)) in y.chunks(d).zip(tokens) {
            out[t * d..(t + 1) * d].iter_mut().zip(row).for_each(|(o, &v)| *o += v * w);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_keeps_the_top_k_renormalised_and_breaks_ties_by_index() {
        // Row 0: experts 2 and 0 lead; row 1: all equal, so the two lowest indices win.
        let logits = [1.0f32, 0.0, 2.0, -1.0, 0.5, 0.5, 0.5, 0.5];
        let r = route(&logits, 4, 2).unwrap();
        let (p0, p2) = (1.0f32.exp(), 2.0f32.exp());
        assert_eq!(r[2][0].0, 0);
        assert!((r[2][0].1 - p2 / (p0 + p2)).abs() < 1e-6 && (r[0][0].1 - p0 / (p0 + p2)).abs() < 1e-6);
        assert_eq!(r[0].iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(r[1], vec![(1, 0.5)]);
        assert!(r[3].is_empty());
        assert!(route(&logits, 4, 5).is_err() && route(&logits[..7], 4, 2).is_err());
    }
}
