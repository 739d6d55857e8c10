//! The gated-delta (Gated DeltaNet) kernel family of the Qwen3.5 linear-attention layers.
//!
//! A layer runs, per token: the causal depthwise conv1d + SiLU over the fused `[q | k | v]`
//! channels ([`conv`]), L2 normalisation of q and k with q scaled by `1/√d_k` ([`norm`]), the
//! decay gate `g = a·softplus(α + dt)` and `β = sigmoid(b)` ([`gates`]), the delta-rule
//! recurrence ([`recurrence`], or its chunked prefill form in [`chunked`]), and the gated
//! RMSNorm `rms(y)·w·silu(z)` ([`norm`]).
//!
//! Layouts (all f32, row-major, tokens outermost):
//!
//! - q, k: `[tokens][n_k_heads][d_k]`; v and the output: `[tokens][n_v_heads][d_v]`;
//!   g and β: `[tokens][n_v_heads]`.
//! - The recurrent state of one sequence is `[n_v_heads][d_v][d_k]`, the TRANSPOSED layout
//!   `state[h·d_v·d_k + j·d_k + i] = S_h[i][j]`, with `i` over the key dimension and `j` over
//!   the value dimension. Row `j` of head `h` is then `d_k` contiguous floats and everything
//!   the recurrence does to it needs only the token's `k`, `q`, `v[j]`, `g` and `β`: rows are
//!   independent work items and every inner loop is a contiguous dot product or axpy.
//! - The conv state of one sequence is `[channels][K − 1]`, oldest tap first, holding the RAW
//!   inputs of the last `K − 1` positions.
//!
//! Several value heads share one key head. Which one is a property of the checkpoint, not of
//! the maths, so it is a parameter ([`KeyHeadMap`]): Hugging Face safetensors group value heads
//! (`h / (n_v/n_k)`), while GGUF files from llama.cpp hold them in tiled order (`h % n_k`).
//!
//! The decode forms are the scan forms run over one-token segments, through the same launcher
//! and the same per-position routine: the scan over n tokens equals n decode steps bit for
//! bit, by construction. The sequential scan is the permanent oracle of the chunked prefill.
//!
//! The CUDA forms of every op, their sources and launchers are in [`cuda`]; these CPU forms are
//! their reference, and each CUDA kernel has a device test against its CPU twin.
//!
//! The state is f32 always. exp in the decay path is the precise library exp: the decay
//! multiplies the state on every token, so an approximate exp's error would compound along the
//! sequence instead of staying a per-token rounding difference.

pub mod chunked;
pub mod conv;
pub mod cuda;
pub mod gates;
pub mod norm;
pub mod recurrence;

pub use chunked::{delta_rule_chunked, DELTA_RULE_CHUNK};
pub use conv::{conv1d_silu_scan, conv1d_silu_step};
pub use gates::{beta_gate, decay_gate, sigmoid, softplus};
pub use norm::{gated_rms_norm, gated_rms_norm_inplace, l2_normalize, normalize_qk, L2_NORM_EPS};
pub use recurrence::{delta_rule_scan, delta_rule_step};

use super::{check_len, Segment};
use crate::error::{Error, Result};

/// Which key head a value head reads (q and k have `n_k_heads`, v and the state `n_v_heads`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyHeadMap {
    /// Value head `h` reads key head `h / (n_v_heads / n_k_heads)`: consecutive value heads
    /// share a key head (Hugging Face safetensors).
    Grouped,
    /// Value head `h` reads key head `h % n_k_heads` (GGUF, whose converter reorders the value
    /// heads to tiled order).
    Tiled,
}

/// Head counts and sizes of one gated-delta layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaRuleHeads {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    /// Key (and query) head size: the length of a state row.
    pub d_k: usize,
    /// Value head size: the number of state rows per head.
    pub d_v: usize,
    pub key_head: KeyHeadMap,
}

impl DeltaRuleHeads {
    /// Floats in one sequence's recurrent state: `n_v_heads · d_v · d_k`.
    pub fn state_len(&self) -> usize {
        self.n_v_heads * self.d_v * self.d_k
    }

    /// The key head that value head `h` reads.
    #[inline]
    pub fn key_head_of(&self, h: usize) -> usize {
        match self.key_head {
            KeyHeadMap::Grouped => h / (self.n_v_heads / self.n_k_heads),
            KeyHeadMap::Tiled => h % self.n_k_heads,
        }
    }

    fn validate(&self) -> Result<()> {
        let DeltaRuleHeads { n_k_heads, n_v_heads, d_k, d_v, .. } = *self;
        if n_k_heads == 0 || n_v_heads == 0 || d_k == 0 || d_v == 0 {
            return Err(Error::Shape(format!("delta rule: empty heads {self:?}")));
        }
        if n_v_heads % n_k_heads != 0 {
            return Err(Error::Shape(format!(
                "delta rule: {n_v_heads} value heads are not a multiple of {n_k_heads} key heads"
            )));
        }
        Ok(())
    }
}

/// The per-token operands of the delta-rule recurrence, in the layouts of the module docs.
/// `q` is expected L2-normalised and already scaled by `1/√d_k`, `k` L2-normalised
/// (see [`normalize_qk`]).
#[derive(Clone, Copy, Debug)]
pub struct DeltaRuleInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// Log-decay per token and value head (`g ≤ 0` from [`decay_gate`]).
    pub g: &'a [f32],
    pub beta: &'a [f32],
}

/// Validates the operands, the segments and the states of a delta-rule launch, and returns
/// the number of token rows.
fn check_delta_rule(
    what: &str,
    heads: &DeltaRuleHeads,
    x: &DeltaRuleInputs,
    segments: &[Segment],
    states: &[&mut [f32]],
    out: &[f32],
) -> Result<usize> {
    heads.validate()?;
    let qk_row = heads.n_k_heads * heads.d_k;
    if x.q.len() % qk_row != 0 {
        return Err(Error::Shape(format!(
            "{what} q: {} elements are not rows of {} key heads × {}",
            x.q.len(),
            heads.n_k_heads,
            heads.d_k
        )));
    }
    let tokens = x.q.len() / qk_row;
    check_len(&format!("{what} k"), x.k.len(), tokens * qk_row)?;
    check_len(&format!("{what} v"), x.v.len(), tokens * heads.n_v_heads * heads.d_v)?;
    check_len(&format!("{what} g"), x.g.len(), tokens * heads.n_v_heads)?;
    check_len(&format!("{what} beta"), x.beta.len(), tokens * heads.n_v_heads)?;
    check_len(&format!("{what} output"), out.len(), tokens * heads.n_v_heads * heads.d_v)?;
    check_segments(what, segments, tokens)?;
    if states.len() != segments.len() {
        return Err(Error::Shape(format!(
            "{what}: {} states for {} sequences",
            states.len(),
            segments.len()
        )));
    }
    for (s, state) in states.iter().enumerate() {
        check_len(&format!("{what} state of sequence {s}"), state.len(), heads.state_len())?;
    }
    Ok(tokens)
}

/// Segments must lie inside the token rows and must not overlap: each one's output rows are
/// written by its own tasks, so an overlap would be a data race, not just a wrong answer.
fn check_segments(what: &str, segments: &[Segment], tokens: usize) -> Result<()> {
    let mut spans: Vec<(usize, usize)> = Vec::with_capacity(segments.len());
    for (s, seg) in segments.iter().enumerate() {
        let end = seg.start.checked_add(seg.len).filter(|&e| e <= tokens).ok_or_else(|| {
            Error::Shape(format!(
                "{what}: sequence {s} spans rows {}..{}+{} of {tokens}",
                seg.start, seg.start, seg.len
            ))
        })?;
        if seg.len > 0 {
            spans.push((seg.start, end));
        }
    }
    spans.sort_unstable();
    for pair in spans.windows(2) {
        if pair[1].0 < pair[0].1 {
            return Err(Error::Shape(format!(
                "{what}: sequences overlap at rows {}..{} and {}..{}",
                pair[0].0, pair[0].1, pair[1].0, pair[1].1
            )));
        }
    }
    Ok(())
}

/// SiLU in the divisor form `x / (1 + e^−x)`, which every backend spells the same way so that
/// they round identically. For x → −∞ the divisor overflows to +∞ and the result is −0, not NaN.
#[inline]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Contiguous f32 dot product in a fixed order: eight interleaved partial sums (so the loop
/// vectorises without reassociation by the compiler), combined pairwise. Every caller that must
/// agree bit for bit with another goes through this one function.
#[inline]
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (&x, &y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[l] += x * y;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

#[cfg(test)]
pub(crate) mod test_util {
    //! Deterministic inputs and error measures shared by the family's tests.

    /// A 64-bit LCG (Knuth's MMIX constants); the top 24 bits give a uniform f32 in [0, 1).
    pub struct Lcg(pub u64);

    impl Lcg {
        pub fn next_u32(&mut self) -> u32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 32) as u32
        }
        pub fn unit(&mut self) -> f32 {
            (self.next_u32() >> 8) as f32 / (1u32 << 24) as f32
        }
        /// Uniform in [lo, hi).
        pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
            lo + (hi - lo) * self.unit()
        }
        pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
            (0..n).map(|_| self.range(lo, hi)).collect()
        }
    }

    /// ‖got − want‖ / ‖want‖, in f64.
    pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
        assert_eq!(got.len(), want.len());
        let (mut d, mut r) = (0.0f64, 0.0f64);
        for (&a, &b) in got.iter().zip(want) {
            d += (a as f64 - b as f64).powi(2);
            r += (b as f64).powi(2);
        }
        if r == 0.0 {
            d.sqrt()
        } else {
            (d / r).sqrt()
        }
    }

    /// Bit equality, with the first difference named.
    pub fn assert_bits_eq(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(a.to_bits() == b.to_bits(), "{what}: element {i}: {a:e} != {b:e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_head_maps() {
        let grouped = DeltaRuleHeads { n_k_heads: 2, n_v_heads: 6, d_k: 4, d_v: 4, key_head: KeyHeadMap::Grouped };
        let tiled = DeltaRuleHeads { key_head: KeyHeadMap::Tiled, ..grouped };
        assert_eq!((0..6).map(|h| grouped.key_head_of(h)).collect::<Vec<_>>(), [0, 0, 0, 1, 1, 1]);
        assert_eq!((0..6).map(|h| tiled.key_head_of(h)).collect::<Vec<_>>(), [0, 1, 0, 1, 0, 1]);
    }

    #[test]
    fn overlapping_or_out_of_range_segments_are_shape_errors() {
        let a = Segment { start: 0, len: 3 };
        let b = Segment { start: 2, len: 2 };
        assert!(matches!(check_segments("t", &[a, b], 8), Err(Error::Shape(_))));
        assert!(matches!(check_segments("t", &[Segment { start: 6, len: 3 }], 8), Err(Error::Shape(_))));
        assert!(matches!(check_segments("t", &[Segment { start: usize::MAX, len: 2 }], 8), Err(Error::Shape(_))));
        assert!(check_segments("t", &[b, Segment { start: 4, len: 0 }, Segment { start: 0, len: 2 }], 8).is_ok());
    }
}
