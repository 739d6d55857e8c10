//! The op set as one interface, so that a model's forward pass is written once and runs on any
//! backend: [`CpuOps`] (the reference, the functions of each kernel family) and
//! [`crate::kernels::cuda_ops::CudaOps`] (their CUDA forms).
//!
//! Buffers are the backend's own (host vectors, device slices); weights are prepared once by
//! [`Ops::matrix`], [`Ops::vector`] and [`Ops::table`] (uploaded, and in a fast mode
//! converted), so a forward pass moves only token ids in and pooled vectors out. Operands that
//! a fused projection produces side by side are [`View`]s: row r of a view starts at
//! `offset + r·stride`, so q, k and v (or gate and up) are read where the GEMM wrote them.

use crate::error::{Error, Result};
use crate::formats::{Matrix, Tensor};
use crate::kernels::activation::silu_mul_views;
use crate::kernels::attention::{attention_views, causal_attention, AttentionShape};
use crate::kernels::gated_delta::{
    conv1d_silu_scan, delta_rule_chunked, delta_rule_scan, gated_rms_norm, normalize_qk, DeltaRuleHeads, DeltaRuleInputs,
    DELTA_RULE_CHUNK,
};
use crate::kernels::matmul::{linear_w, linear_w_into};
use crate::kernels::moe::{mlp_shape, moe_experts, Expert};
use crate::kernels::norm::{add_norm, residual_norm, rms_norm};
use crate::kernels::pool::mean_pool;
use crate::kernels::rope::{head_prep_view, HeadPrep, RopeTable};
use crate::kernels::sample::{select_rows, LogitsWant, StepLogits};
use crate::kernels::{check_len, Segment};

/// Rows of a buffer: row r is `width` elements at `offset + r·stride` (width known to the op).
pub struct View<'a, B> {
    pub buf: &'a B,
    pub offset: usize,
    pub stride: usize,
}

// Copy for any B (a derive would ask B: Copy): a view is a reference and two numbers.
impl<B> Clone for View<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for View<'_, B> {}

impl<'a, B> View<'a, B> {
    pub fn new(buf: &'a B, offset: usize, stride: usize) -> Self {
        View { buf, offset, stride }
    }
}

/// The activation of a gated linear unit ([`Ops::glu`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum GatedActivation {
    Silu,
    GeluTanh,
}

/// What [`Ops::head_prep`] does to each head: RMS-norm (with or without a weight) and RoPE.
pub struct HeadOps<'a, O: Ops> {
    pub heads: usize,
    pub hd: usize,
    pub norm: Option<Option<&'a O::Vector>>,
    pub eps: f32,
    pub rope: Option<&'a O::Rope>,
}

/// A fused attention projection's rows, `stride` wide ([`Ops::projected_kv_attention`]): the
/// first columns of its q, gate, k and v sections, and what [`Ops::head_prep`] does to the q
/// and k heads.
pub struct ProjectedHeads<'a, O: Ops> {
    pub stride: usize,
    pub q: usize,
    pub gate: usize,
    pub k: usize,
    pub v: usize,
    pub q_prep: HeadOps<'a, O>,
    pub k_prep: HeadOps<'a, O>,
}

/// The sandwich-norm step after a sublayer's output y ([`Ops::ffn_add_norm`],
/// [`Ops::attention_add_norm_next`]): `h = (h + rms(y)·weight)·post` per row of `d`, epsilon `eps`.
pub struct SandwichNorm<'a, O: Ops> {
    pub weight: &'a O::Vector,
    pub post: f32,
    pub d: usize,
    pub eps: f32,
}

impl<O: Ops> Clone for SandwichNorm<'_, O> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<O: Ops> Copy for SandwichNorm<'_, O> {}

/// The operands of [`Ops::gated_delta`]: the conv output `qkv` ([rows][q | k | v]), the output
/// gate `z` ([rows][n_v_heads·d_v]), the gate projections `alpha` and `b` ([rows][n_v_heads])
/// with the layer's `dt_bias` and `a`, and the norm's weight (one head's d_v) and epsilon.
pub struct GatedDeltaInputs<'a, O: Ops> {
    pub qkv: &'a O::Buf,
    pub z: &'a O::Buf,
    pub alpha: &'a O::Buf,
    pub b: &'a O::Buf,
    pub dt_bias: &'a O::Vector,
    pub a: &'a O::Vector,
    pub norm: &'a O::Vector,
    pub eps: f32,
}

/// `v` as `rows` rows of equal length.
pub fn split_rows(v: &[f32], rows: usize) -> Result<Vec<Vec<f32>>> {
    if v.is_empty() {
        return Ok(vec![Vec::new(); rows]);
    }
    if rows == 0 || v.len() % rows != 0 {
        return Err(Error::Shape(format!("{} values are not {rows} rows of one length", v.len())));
    }
    Ok(v.chunks(v.len() / rows).map(|r| r.to_vec()).collect())
}

/// [`Ops::gated_delta`] as its three ops, one after another.
pub fn gated_delta_in_steps<O: Ops>(ops: &O, x: GatedDeltaInputs<O>, heads: &DeltaRuleHeads, batch: &O::Batch, states: &mut [&mut O::Buf]) -> Result<O::Buf> {
    let (g, beta) = ops.gdn_gates(x.alpha, x.b, x.dt_bias, x.a)?;
    let core = ops.delta_rule(x.qkv, &g, &beta, heads, batch, states)?;
    ops.gated_rms_norm(&core, x.z, x.norm, x.eps)
}

/// The op set over one backend's buffers. Every method validates shapes first and names what
/// is wrong; the CPU forms are the reference the others are tested against.
pub trait Ops: Send + Sync + Sized {
    /// f32 activations, row-major.
    type Buf: Send + Sync;
    /// A weight matrix [out][in] as the backend multiplies it.
    type Mat: Send + Sync;
    /// A small f32 vector (norm weights, biases).
    type Vector: Send + Sync;
    /// An f32 lookup table [rows][width] (embeddings), never converted.
    type Table: Send + Sync;
    type Rope: Send + Sync;
    /// A packed batch's token ids, segments and positions, prepared once per forward pass.
    type Batch;
    /// One sequence's key/value cache of one attention layer.
    type Kv: Send + Sync;
    /// The experts of one mixture-of-experts layer.
    type Experts: Send + Sync;

    /// A weight matrix in the dtype it is stored in (f32, bf16 or Q8_0); the backend keeps it
    /// so or converts it to the dtype its products take.
    fn matrix(&self, w: Matrix) -> Result<Self::Mat>;
    /// Matrices that read the same input, stacked by output rows: one [`Ops::linear`] with the
    /// result writes `[rows][Σ out]`, each part's outputs side by side. A GPU stacks them into one
    /// GEMM (fewer, larger launches).
    fn stacked(&self, name: String, parts: Vec<Matrix>) -> Result<Self::Mat>;
    fn vector(&self, v: Vec<f32>) -> Result<Self::Vector>;
    fn table(&self, t: Matrix) -> Result<Self::Table>;
    fn rope(&self, t: RopeTable) -> Result<Self::Rope>;
    /// Experts as `(gate, up, down)` matrices, each [intermediate][hidden] or [hidden][intermediate],
    /// and the layer's shared expert (of its own intermediate width) if it has one.
    fn experts(&self, experts: Vec<[Matrix; 3]>, shared: Option<[Matrix; 3]>) -> Result<Self::Experts>;
    /// The batch of `ids` laid out by `segments`; the ids were checked against the vocabulary.
    fn batch(&self, segments: &[Segment], ids: &[u32]) -> Result<Self::Batch> {
        self.batch_at(segments, ids, &vec![0; segments.len()])
    }
    /// [`Ops::batch`] whose sequence `s` starts at position `past[s]` (what its caches hold).
    fn batch_at(&self, segments: &[Segment], ids: &[u32], past: &[usize]) -> Result<Self::Batch>;
    /// `len` zeros (a fresh recurrent or conv state).
    fn zeros(&self, len: usize) -> Result<Self::Buf>;
    /// An empty KV cache for rows of `width` keys and as many values.
    fn kv_cache(&self, width: usize) -> Result<Self::Kv>;
    /// Makes room in `kv`, which holds `filled` rows, for `need` rows. Every step reserves its
    /// caches before it runs, so that a recorded step ([`Ops::run_step`]) allocates nothing
    /// that outlives it; [`Ops::kv_attention`] refuses a cache reserved for another position.
    fn kv_reserve(&self, kv: &mut Self::Kv, filled: usize, need: usize) -> Result<()>;
    /// Runs one forward step `f` on the batch of `ids` (sequence s after `past[s]` positions)
    /// and returns what `read` makes of its result (the host's copy of it, or a part). Given a
    /// `key`, a backend may record the work `f` queues and replay it for later steps of the
    /// same key (CUDA graphs; `read` runs after the replay, outside it). A replay changes only
    /// the batch's ids and positions, so the key must name everything else the work depends on:
    /// the batch's shape and every buffer the step reads or writes besides the weights (see
    /// [`Ops::buf_handle`]); and `f` must queue the same work for equal keys.
    fn run_step<R>(
        &self,
        segments: &[Segment],
        ids: &[u32],
        past: &[usize],
        key: Option<&[u64]>,
        f: &mut dyn FnMut(&Self::Batch) -> Result<Self::Buf>,
        read: &dyn Fn(&Self::Buf) -> Result<R>,
    ) -> Result<R> {
        let _ = key;
        let batch = self.batch_at(segments, ids, past)?;
        let y = f(&batch)?;
        read(&y)
    }
    /// A number that names a buffer in [`Ops::run_step`] keys (its address).
    fn buf_handle(&self, b: &Self::Buf) -> u64;
    /// Numbers that name a KV cache's buffers, as [`Ops::buf_handle`].
    fn kv_handle(&self, kv: &Self::Kv) -> [u64; 3];
    /// The segments a batch was made from.
    fn segments<'b>(&self, batch: &'b Self::Batch) -> &'b [Segment];
    /// A guard that a forward pass holds when the backend runs one pass at a time.
    fn serialize(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        None
    }

    /// Rows `table[ids[r]] · scale` for the batch's ids (checked against the table).
    fn embed(&self, table: &Self::Table, batch: &Self::Batch, scale: f32) -> Result<Self::Buf>;
    /// `x·Wᵀ (+ bias)` over `rows` rows.
    fn linear(&self, x: &Self::Buf, rows: usize, w: &Self::Mat, bias: Option<&Self::Vector>) -> Result<Self::Buf>;
    /// `x·W_iᵀ` for each matrix, over the same `rows` rows of x: what [`Ops::linear`] gives for
    /// each; a GPU may run them as one launch.
    fn linears(&self, x: &Self::Buf, rows: usize, ws: &[&Self::Mat]) -> Result<Vec<Self::Buf>> {
        ws.iter().map(|w| self.linear(x, rows, w, None)).collect()
    }
    /// A gated-delta layer's input projections and the causal conv1d + SiLU of the first
    /// one's `channels` outputs (`conv`: its weights [channels][kernel] and the kernel width;
    /// `states`: each sequence's raw-input history, advanced): [`Ops::linears`], then
    /// [`Ops::conv1d_silu`] of the first output. A GPU may convolve each channel as the product
    /// writes it, with the same results.
    #[allow(clippy::too_many_arguments)]
    fn linears_conv(
        &self,
        x: &Self::Buf,
        rows: usize,
        ws: &[&Self::Mat],
        conv: (&Self::Vector, usize),
        channels: usize,
        batch: &Self::Batch,
        states: &mut [&mut Self::Buf],
    ) -> Result<Vec<Self::Buf>> {
        linears_conv_composed(self, x, rows, ws, conv, channels, batch, states)
    }
    /// The gated linear unit: `act(x·Gᵀ)·(x·Uᵀ)` over `rows` rows for `gate_up` stacking a gate
    /// [width][in] over an up [width][in] (a fused gate|up product); [rows][width]. The product,
    /// then the gated activation of its halves; a GPU may apply the activation as the product
    /// writes its outputs.
    fn glu(&self, x: &Self::Buf, rows: usize, gate_up: &Self::Mat, width: usize, act: GatedActivation) -> Result<Self::Buf> {
        let gu = self.linear(x, rows, gate_up, None)?;
        let (g, u) = (View::new(&gu, 0, 2 * width), View::new(&gu, width, 2 * width));
        match act {
            GatedActivation::Silu => self.silu_mul(g, u, rows, width),
            GatedActivation::GeluTanh => self.gelu_tanh_mul(g, u, rows, width),
        }
    }
    /// `rms(pre·x)·w` per row of `d`.
    fn rms_norm(&self, x: &Self::Buf, d: usize, w: Option<&Self::Vector>, pre: f32, eps: f32) -> Result<Self::Buf>;
    /// `h = (h + rms(y)·w)·post` per row of `d`.
    fn add_norm(&self, h: &mut Self::Buf, y: &Self::Buf, w: &Self::Vector, post: f32, d: usize, eps: f32) -> Result<()>;
    /// [`Ops::add_norm`], then the next pre-norm `rms(h)·next` from the same pass, into `out`
    /// (the previous normalised input, dead by now: reusing it spares an allocation a layer).
    #[allow(clippy::too_many_arguments)]
    fn add_norm_next(
        &self,
        h: &mut Self::Buf,
        y: &Self::Buf,
        w: &Self::Vector,
        post: f32,
        d: usize,
        eps: f32,
        next: &Self::Vector,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// A sublayer's output projection and the sandwich-norm step after it: `y = linear(v, w)`,
    /// then [`Ops::add_norm_next`] of `y`. A backend may do both in one pass, with the same
    /// results.
    #[allow(clippy::too_many_arguments)]
    fn linear_add_norm_next(
        &self,
        v: &Self::Buf,
        rows: usize,
        w: &Self::Mat,
        h: &mut Self::Buf,
        norm: &Self::Vector,
        post: f32,
        d: usize,
        eps: f32,
        next: &Self::Vector,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let y = self.linear(v, rows, w, None)?;
        self.add_norm_next(h, &y, norm, post, d, eps, next, out)
    }
    /// A feed-forward block and the sandwich-norm step after it: `g = glu(a)` ([`Ops::glu`]),
    /// `y = g·downᵀ`, the step `norm` on h, then with `next` the next pre-norm
    /// `a = rms(h)·next` ([`Ops::linear_add_norm_next`]; without it `a` is left as it was).
    /// A backend may hand `g` from the activation to the product in the precision the product
    /// reads, with the same results.
    #[allow(clippy::too_many_arguments)]
    fn ffn_add_norm(
        &self,
        a: &mut Self::Buf,
        rows: usize,
        (gate_up, width, act): (&Self::Mat, usize, GatedActivation),
        down: &Self::Mat,
        h: &mut Self::Buf,
        norm: SandwichNorm<Self>,
        next: Option<&Self::Vector>,
    ) -> Result<()> {
        ffn_add_norm_composed(self, a, rows, (gate_up, width, act), down, h, norm, next)
    }
    /// `gelu_tanh(g)·u` over `rows × width`, contiguous out.
    fn gelu_tanh_mul(&self, g: View<Self::Buf>, u: View<Self::Buf>, rows: usize, width: usize) -> Result<Self::Buf>;
    /// `gelu_tanh(x·Wᵀ)·u` over `rows` rows of `width` (W [width][in]; u a view of another
    /// tensor: EmbeddingGemma 2's per-layer input gate): [`Ops::linear`], then
    /// [`Ops::gelu_tanh_mul`]. A GPU may apply the gelu and the product with u as the product
    /// writes its outputs, with the same results.
    fn linear_gelu_mul(&self, x: &Self::Buf, rows: usize, w: &Self::Mat, width: usize, u: View<Self::Buf>) -> Result<Self::Buf> {
        linear_gelu_mul_composed(self, x, rows, w, width, u)
    }
    /// In place on the heads of `x`'s rows (row stride `stride`), at each row's position in
    /// `batch`: per section `(offset, prep)`, `prep.heads` heads from column `offset` (the q,
    /// k and v of one fused projection, prepared together).
    fn head_prep(&self, x: &mut Self::Buf, stride: usize, batch: &Self::Batch, sections: &[(usize, HeadOps<Self>)]) -> Result<()>;
    /// Attention within each sequence of `batch`; out is [rows][q_heads·hd].
    fn attention(
        &self,
        q: View<Self::Buf>,
        k: View<Self::Buf>,
        v: View<Self::Buf>,
        batch: &Self::Batch,
        shape: &AttentionShape,
    ) -> Result<Self::Buf>;
    /// An attention sublayer's end: [`Ops::attention`], then its output projection and the
    /// sandwich-norm step after it ([`Ops::linear_add_norm_next`] of the attention's `rows`
    /// rows through `wo`). A backend may hand the attention's rows to the product in the
    /// precision the product reads, with the same results.
    #[allow(clippy::too_many_arguments)]
    fn attention_add_norm_next(
        &self,
        (q, k, v): (View<Self::Buf>, View<Self::Buf>, View<Self::Buf>),
        batch: &Self::Batch,
        shape: &AttentionShape,
        rows: usize,
        wo: &Self::Mat,
        h: &mut Self::Buf,
        norm: SandwichNorm<Self>,
        next: &Self::Vector,
        out: &mut Self::Buf,
    ) -> Result<()> {
        attention_add_norm_next_composed(self, (q, k, v), batch, shape, rows, wo, h, norm, next, out)
    }
    /// Mean of each sequence's rows, [sequences][d].
    fn mean_pool(&self, h: &Self::Buf, d: usize, batch: &Self::Batch) -> Result<Self::Buf>;
    fn to_host(&self, x: &Self::Buf) -> Result<Vec<f32>>;
    /// [`Ops::to_host`] as `rows` rows of equal length (a step's output, one row a sequence).
    fn to_host_rows(&self, x: &Self::Buf, rows: usize) -> Result<Vec<Vec<f32>>> {
        split_rows(&self.to_host(x)?, rows)
    }
    /// Each sequence's next-token logits from `logits` ([wants.len()][vocab]) as `wants[s]`
    /// asks: the whole row, or its best entries (kernels/sample). A GPU picks the best entries
    /// where the logits are, so that only they are copied.
    fn select_logits(&self, logits: &Self::Buf, vocab: usize, wants: &[LogitsWant]) -> Result<Vec<StepLogits>> {
        select_rows(self.to_host_rows(logits, wants.len())?, vocab, wants)
    }

    // The LLM's ops (Qwen3.5).

    /// `x += y`, then `out = rms(x)·w` per row of `d` (pre-norm residual stream).
    #[allow(clippy::too_many_arguments)]
    fn residual_norm(&self, x: &mut Self::Buf, y: &Self::Buf, w: &Self::Vector, d: usize, eps: f32, out: &mut Self::Buf) -> Result<()>;
    /// A sublayer's output projection and the residual step after it: `x += linear(v, w)`,
    /// then `out = rms(x)·norm` per row of `d` ([`Ops::linear`], then [`Ops::residual_norm`]).
    /// A backend may do both in one pass, with the same results.
    #[allow(clippy::too_many_arguments)]
    fn linear_residual_norm(
        &self,
        v: &Self::Buf,
        rows: usize,
        w: &Self::Mat,
        x: &mut Self::Buf,
        norm: &Self::Vector,
        d: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let y = self.linear(v, rows, w, None)?;
        self.residual_norm(x, &y, norm, d, eps, out)
    }
    /// [`Ops::linear_residual_norm`], then [`Ops::glu`] of its output `out` (a dense FFN after
    /// its sublayer's residual step); `out` is written too. A backend may form the norm inside
    /// the gated product instead of after the first product, with the same results.
    #[allow(clippy::too_many_arguments)]
    fn linear_residual_norm_glu(
        &self,
        v: &Self::Buf,
        rows: usize,
        w: &Self::Mat,
        x: &mut Self::Buf,
        norm: &Self::Vector,
        d: usize,
        eps: f32,
        out: &mut Self::Buf,
        gate_up: &Self::Mat,
        width: usize,
        act: GatedActivation,
    ) -> Result<Self::Buf> {
        self.linear_residual_norm(v, rows, w, x, norm, d, eps, out)?;
        self.glu(out, rows, gate_up, width, act)
    }
    /// [`Ops::linear_residual_norm`], then [`Ops::linear`] of its output `out` through `next`
    /// (a dense FFN's down projection, then the next attention layer's input product); `out`
    /// is written too. A backend may form the norm inside the second product instead of after
    /// the first, with the same results.
    #[allow(clippy::too_many_arguments)]
    fn linear_residual_norm_linear(
        &self,
        (v, rows, w): (&Self::Buf, usize, &Self::Mat),
        x: &mut Self::Buf,
        norm: &Self::Vector,
        d: usize,
        eps: f32,
        out: &mut Self::Buf,
        next: &Self::Mat,
    ) -> Result<Self::Buf> {
        self.linear_residual_norm(v, rows, w, x, norm, d, eps, out)?;
        self.linear(out, rows, next, None)
    }
    /// [`Ops::linear_residual_norm`], then [`Ops::linears_conv`] of its output `out` (a dense
    /// FFN's down projection, then the next gated-delta layer's input projections and conv);
    /// `out` is written too. A backend may form the norm inside the second products instead of
    /// after the first, with the same results.
    #[allow(clippy::too_many_arguments)]
    fn linear_residual_norm_linears_conv(
        &self,
        (v, rows, w): (&Self::Buf, usize, &Self::Mat),
        x: &mut Self::Buf,
        norm: &Self::Vector,
        d: usize,
        eps: f32,
        out: &mut Self::Buf,
        ws: &[&Self::Mat],
        conv: (&Self::Vector, usize),
        channels: usize,
        batch: &Self::Batch,
        states: &mut [&mut Self::Buf],
    ) -> Result<Vec<Self::Buf>> {
        self.linear_residual_norm(v, rows, w, x, norm, d, eps, out)?;
        self.linears_conv(out, rows, ws, conv, channels, batch, states)
    }
    /// `silu(g)·u` over `rows × width`, contiguous out.
    fn silu_mul(&self, g: View<Self::Buf>, u: View<Self::Buf>, rows: usize, width: usize) -> Result<Self::Buf>;
    /// Each sequence's last row of `x` (rows of `d`), [sequences][d].
    fn last_rows(&self, x: &Self::Buf, d: usize, batch: &Self::Batch) -> Result<Self::Buf>;
    /// Causal depthwise conv1d + SiLU over `x`'s rows of `channels`, each sequence after its
    /// own raw-input history `states[s]` (updated).
    #[allow(clippy::too_many_arguments)]
    fn conv1d_silu(
        &self,
        x: &Self::Buf,
        channels: usize,
        w: &Self::Vector,
        kernel: usize,
        batch: &Self::Batch,
        states: &mut [&mut Self::Buf],
    ) -> Result<Self::Buf>;
    /// Decay `g = a·softplus(alpha + dt_bias)` and `β = sigmoid(b)`, both [rows][heads].
    fn gdn_gates(&self, alpha: &Self::Buf, b: &Self::Buf, dt_bias: &Self::Vector, a: &Self::Vector) -> Result<(Self::Buf, Self::Buf)>;
    /// The delta rule over `qkv`'s rows `[q | k | v]` (raw q, k: L2-normalised here, q scaled
    /// by `1/√d_k`), each sequence advancing its own state; out [rows][n_v_heads·d_v].
    #[allow(clippy::too_many_arguments)]
    fn delta_rule(
        &self,
        qkv: &Self::Buf,
        g: &Self::Buf,
        beta: &Self::Buf,
        heads: &DeltaRuleHeads,
        batch: &Self::Batch,
        states: &mut [&mut Self::Buf],
    ) -> Result<Self::Buf>;
    /// `rms(y)·w·silu(z)` per row of `w.len()` (one head), w shared by every head.
    fn gated_rms_norm(&self, y: &Self::Buf, z: &Self::Buf, w: &Self::Vector, eps: f32) -> Result<Self::Buf>;
    /// A linear-attention layer's core from its projections: the gates from `alpha` and `b`
    /// ([`Ops::gdn_gates`]), the delta rule over `qkv` ([`Ops::delta_rule`]) and its output
    /// through the gated RMS norm with `z` ([`Ops::gated_rms_norm`]). A backend may do the
    /// three in fewer passes, with the same results.
    fn gated_delta(&self, x: GatedDeltaInputs<Self>, heads: &DeltaRuleHeads, batch: &Self::Batch, states: &mut [&mut Self::Buf]) -> Result<Self::Buf> {
        gated_delta_in_steps(self, x, heads, batch, states)
    }
    /// Appends each sequence's new k, v rows to its cache, then causal attention of its queries
    /// over the cache, times `sigmoid(gate)`; out [rows][q_heads·hd]. The batch's positions
    /// must start where each cache ends.
    #[allow(clippy::too_many_arguments)]
    fn kv_attention(
        &self,
        q: View<Self::Buf>,
        k: View<Self::Buf>,
        v: View<Self::Buf>,
        gate: View<Self::Buf>,
        batch: &Self::Batch,
        caches: &mut [&mut Self::Kv],
        shape: &AttentionShape,
    ) -> Result<Self::Buf>;
    /// [`Ops::head_prep`] of the q and k heads of the fused projection `y`, in place, then
    /// [`Ops::kv_attention`] over its sections. A backend may prepare the heads inside the
    /// attention instead (y's q and k then keep their projected values), with the same results.
    fn projected_kv_attention(
        &self,
        y: &mut Self::Buf,
        heads: ProjectedHeads<Self>,
        batch: &Self::Batch,
        caches: &mut [&mut Self::Kv],
        shape: &AttentionShape,
    ) -> Result<Self::Buf> {
        projected_kv_attention_composed(self, y, heads, batch, caches, shape)
    }
    /// A MoE layer's FFN for each row of `x` (rows of `d`): the routed experts' mix — softmax
    /// of the experts' logits in f32 → top-k → renormalised weights, Σ weight·down(silu(gate·x)·up·x)
    /// — then, with a shared expert, `+= sigmoid(g)·shared(x)`. `router_logits` is [rows][experts],
    /// or [rows][experts + 1] with the shared expert's gate logit g last (the router and that
    /// gate stacked into one product).
    fn moe(&self, x: &Self::Buf, d: usize, router_logits: &Self::Buf, experts: &Self::Experts, top_k: usize) -> Result<Self::Buf>;
    /// A MoE layer and the residual step after it: `x += moe(a)` ([`Ops::moe`] of the normed
    /// input `a`), then `a = rms(x)·norm` per row of `d` ([`Ops::residual_norm`]), the next
    /// sublayer's input replacing this one's. A backend may do both in fewer passes, with the
    /// same results.
    #[allow(clippy::too_many_arguments)]
    fn moe_residual_norm(
        &self,
        a: &mut Self::Buf,
        d: usize,
        router_logits: &Self::Buf,
        experts: &Self::Experts,
        top_k: usize,
        x: &mut Self::Buf,
        norm: &Self::Vector,
        eps: f32,
    ) -> Result<()> {
        let y = self.moe(a, d, router_logits, experts, top_k)?;
        self.residual_norm(x, &y, norm, d, eps, a)
    }
}

/// A MoE layer's experts on the host: the routed ones, and the shared expert (gate|up, down,
/// its width).
pub struct CpuExperts {
    pub routed: Vec<Expert>,
    pub shared: Option<(CpuMat, CpuMat, usize)>,
}

/// The CPU reference backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuOps;

/// A packed batch on the host.
pub struct CpuBatch {
    pub segments: Vec<Segment>,
    pub positions: Vec<u32>,
    pub ids: Vec<u32>,
}

impl CpuBatch {
    pub fn new(segments: &[Segment], ids: &[u32]) -> Self {
        let positions = segments.iter().flat_map(|s| 0..s.len as u32).collect();
        CpuBatch { segments: segments.to_vec(), positions, ids: ids.to_vec() }
    }
    pub fn rows(&self) -> usize {
        self.positions.len()
    }
}

/// A matrix with its dimensions: one tensor, or the parts of a stacked matrix kept as loaded
/// (mapped, not copied: on the CPU a product per part costs the same as one stacked product,
/// while a stacked copy would hold the weights twice, the copy and the mapped pages it was read
/// from).
pub struct CpuMat {
    pub parts: Vec<Matrix>,
    pub out: usize,
    pub inp: usize,
}

/// Checks that `rows` rows of `width` at `offset + r·stride` fit a buffer of `len`.
pub fn check_view(what: &str, len: usize, offset: usize, stride: usize, rows: usize, width: usize) -> Result<()> {
    if rows > 1 && stride < width {
        return Err(Error::Shape(format!("{what}: row stride {stride} is shorter than a row of {width}")));
    }
    let need = if rows == 0 { 0 } else { offset + (rows - 1) * stride + width };
    if need > len {
        return Err(Error::Shape(format!("{what}: {rows} rows of {width} need {need} elements, the buffer has {len}")));
    }
    Ok(())
}

/// Matrix shape of a 2-D tensor.
pub fn matrix_dims(w: &Tensor) -> Result<(usize, usize)> {
    match w.shape[..] {
        [out, inp] => Ok((out, inp)),
        _ => Err(Error::Shape(format!("{}: a matrix needs 2 dimensions, the tensor has {:?}", w.name, w.shape))),
    }
}

/// One sequence's KV cache of one layer on the host: rows of `width` keys and values.
pub struct CpuKv {
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
    pub width: usize,
}

impl CpuKv {
    pub fn rows(&self) -> usize {
        self.keys.len() / self.width.max(1)
    }
}

impl Ops for CpuOps {
    type Buf = Vec<f32>;
    type Mat = CpuMat;
    type Vector = Vec<f32>;
    type Table = Matrix;
    type Rope = RopeTable;
    type Batch = CpuBatch;
    type Kv = CpuKv;
    type Experts = CpuExperts;

    fn matrix(&self, w: Matrix) -> Result<CpuMat> {
        let (out, inp) = matrix_shape(&w)?;
        Ok(CpuMat { parts: vec![w], out, inp })
    }

    fn stacked(&self, name: String, parts: Vec<Matrix>) -> Result<CpuMat> {
        let (mut out, mut inp) = (0, None);
        for t in &parts {
            let (o, i) = matrix_shape(t)?;
            if *inp.get_or_insert(i) != i {
                return Err(Error::tensor(t.name(), format!("{i} columns cannot stack in {name} under rows of {}", inp.unwrap_or(0))));
            }
            out += o;
        }
        let inp = inp.ok_or_else(|| Error::tensor(&name, "nothing to stack"))?;
        Ok(CpuMat { parts, out, inp })
    }
    fn vector(&self, v: Vec<f32>) -> Result<Vec<f32>> {
        Ok(v)
    }
    fn table(&self, t: Matrix) -> Result<Matrix> {
        matrix_shape(&t)?;
        Ok(t)
    }
    fn rope(&self, t: RopeTable) -> Result<RopeTable> {
        Ok(t)
    }
    fn experts(&self, experts: Vec<[Matrix; 3]>, shared: Option<[Matrix; 3]>) -> Result<CpuExperts> {
        let routed = experts.into_iter().map(Expert::new).collect::<Result<Vec<_>>>()?;
        let shared = match shared {
            Some(matrices) => {
                let (width, hidden) = mlp_shape(&matrices)?;
                let [gate, up, down] = matrices;
                if routed.iter().any(|e| e.hidden != hidden) {
                    return Err(Error::tensor(down.name(), "shared expert matrices do not fit the experts' hidden size"));
                }
                let name = gate.name().to_string();
                Some((self.stacked(name, vec![gate, up])?, self.matrix(down)?, width))
            }
            None => None,
        };
        Ok(CpuExperts { routed, shared })
    }
    fn batch_at(&self, segments: &[Segment], ids: &[u32], past: &[usize]) -> Result<CpuBatch> {
        check_past(segments, past)?;
        let positions = segments.iter().zip(past).flat_map(|(s, &p)| (p..p + s.len).map(|v| v as u32)).collect();
        Ok(CpuBatch { segments: segments.to_vec(), positions, ids: ids.to_vec() })
    }
    fn zeros(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }
    fn kv_cache(&self, width: usize) -> Result<CpuKv> {
        Ok(CpuKv { keys: Vec::new(), values: Vec::new(), width })
    }

    fn kv_reserve(&self, kv: &mut CpuKv, _filled: usize, need: usize) -> Result<()> {
        let more = (need * kv.width).saturating_sub(kv.keys.len());
        kv.keys.reserve(more);
        kv.values.reserve(more);
        Ok(())
    }

    fn buf_handle(&self, b: &Vec<f32>) -> u64 {
        b.as_ptr() as u64
    }

    fn kv_handle(&self, kv: &CpuKv) -> [u64; 3] {
        [kv.keys.as_ptr() as u64, kv.values.as_ptr() as u64, kv.keys.capacity() as u64]
    }

    fn segments<'b>(&self, batch: &'b CpuBatch) -> &'b [Segment] {
        &batch.segments
    }

    fn embed(&self, table: &Matrix, batch: &CpuBatch, scale: f32) -> Result<Vec<f32>> {
        crate::kernels::embedding::embed_lookup(table, &batch.ids, scale)
    }

    fn linear(&self, x: &Vec<f32>, rows: usize, w: &CpuMat, bias: Option<&Vec<f32>>) -> Result<Vec<f32>> {
        let mut y = match &w.parts[..] {
            [one] => linear_w(x, rows, one.into(), w.out, w.inp)?,
            parts => {
                let mut y = vec![0.0f32; rows * w.out];
                let mut col = 0;
                for p in parts {
                    let o = p.shape()[0];
                    match p {
                        Matrix::F32(t) => crate::kernels::matmul::linear_into_columns(x, rows, t.data(), o, w.inp, &mut y, col, w.out)?,
                        other => {
                            let mut part = vec![0.0f32; rows * o];
                            linear_w_into(x, rows, other.into(), o, w.inp, &mut part)?;
                            for (dst, src) in y.chunks_mut(w.out).zip(part.chunks(o)) {
                                dst[col..col + o].copy_from_slice(src);
                            }
                        }
                    }
                    col += o;
                }
                y
            }
        };
        if let Some(b) = bias {
            crate::kernels::matmul::add_bias(&mut y, b)?;
        }
        Ok(y)
    }

    fn rms_norm(&self, x: &Vec<f32>, d: usize, w: Option<&Vec<f32>>, pre: f32, eps: f32) -> Result<Vec<f32>> {
        let mut y = vec![0.0f32; x.len()];
        rms_norm(x, d, w.map(|w| &w[..]), pre, eps, &mut y)?;
        Ok(y)
    }

    fn add_norm(&self, h: &mut Vec<f32>, y: &Vec<f32>, w: &Vec<f32>, post: f32, d: usize, eps: f32) -> Result<()> {
        add_norm(h, y, w, post, d, eps, None)
    }

    fn add_norm_next(
        &self,
        h: &mut Vec<f32>,
        y: &Vec<f32>,
        w: &Vec<f32>,
        post: f32,
        d: usize,
        eps: f32,
        next: &Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        add_norm(h, y, w, post, d, eps, Some((next, out)))
    }

    fn gelu_tanh_mul(&self, g: View<Vec<f32>>, u: View<Vec<f32>>, rows: usize, width: usize) -> Result<Vec<f32>> {
        crate::kernels::activation::gelu_tanh_mul_views((g.buf, g.offset, g.stride), (u.buf, u.offset, u.stride), rows, width)
    }

    fn head_prep(&self, x: &mut Vec<f32>, stride: usize, batch: &CpuBatch, sections: &[(usize, HeadOps<Self>)]) -> Result<()> {
        for (offset, prep) in sections {
            let p = HeadPrep { heads: prep.heads, hd: prep.hd, norm: prep.norm.map(|w| w.map(|w| &w[..])), eps: prep.eps, rope: prep.rope };
            head_prep_view(x, *offset, stride, batch.rows(), &batch.positions, &p)?;
        }
        Ok(())
    }

    fn attention(
        &self,
        q: View<Vec<f32>>,
        k: View<Vec<f32>>,
        v: View<Vec<f32>>,
        batch: &CpuBatch,
        shape: &AttentionShape,
    ) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; batch.rows() * shape.q_heads * shape.hd];
        attention_views((q.buf, q.offset, q.stride), (k.buf, k.offset, k.stride), (v.buf, v.offset, v.stride), &batch.segments, shape, &mut out)?;
        Ok(out)
    }

    fn mean_pool(&self, h: &Vec<f32>, d: usize, batch: &CpuBatch) -> Result<Vec<f32>> {
        mean_pool(h, d, &batch.segments)
    }

    fn to_host(&self, x: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(x.clone())
    }

    fn to_host_rows(&self, x: &Vec<f32>, rows: usize) -> Result<Vec<Vec<f32>>> {
        split_rows(x, rows)
    }

    fn residual_norm(&self, x: &mut Vec<f32>, y: &Vec<f32>, w: &Vec<f32>, d: usize, eps: f32, out: &mut Vec<f32>) -> Result<()> {
        residual_norm(x, y, w, d, eps, out)
    }

    fn silu_mul(&self, g: View<Vec<f32>>, u: View<Vec<f32>>, rows: usize, width: usize) -> Result<Vec<f32>> {
        silu_mul_views((g.buf, g.offset, g.stride), (u.buf, u.offset, u.stride), rows, width)
    }

    fn last_rows(&self, x: &Vec<f32>, d: usize, batch: &CpuBatch) -> Result<Vec<f32>> {
        check_len("last_rows input", x.len(), batch.rows() * d)?;
        Ok(batch.segments.iter().flat_map(|s| x[(s.start + s.len - 1) * d..(s.start + s.len) * d].iter().copied()).collect())
    }

    fn conv1d_silu(
        &self,
        x: &Vec<f32>,
        channels: usize,
        w: &Vec<f32>,
        kernel: usize,
        batch: &CpuBatch,
        states: &mut [&mut Vec<f32>],
    ) -> Result<Vec<f32>> {
        check_len("conv1d_silu input", x.len(), batch.rows() * channels)?;
        let mut out = vec![0.0f32; x.len()];
        let mut states: Vec<&mut [f32]> = states.iter_mut().map(|s| s.as_mut_slice()).collect();
        conv1d_silu_scan(x, &batch.segments, w, kernel, &mut states, &mut out)?;
        Ok(out)
    }

    fn gdn_gates(&self, alpha: &Vec<f32>, b: &Vec<f32>, dt_bias: &Vec<f32>, a: &Vec<f32>) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut g, mut beta) = (vec![0.0f32; alpha.len()], vec![0.0f32; b.len()]);
        crate::kernels::gated_delta::decay_gate(alpha, dt_bias, a, &mut g)?;
        crate::kernels::gated_delta::beta_gate(b, &mut beta)?;
        Ok((g, beta))
    }

    fn delta_rule(
        &self,
        qkv: &Vec<f32>,
        g: &Vec<f32>,
        beta: &Vec<f32>,
        heads: &DeltaRuleHeads,
        batch: &CpuBatch,
        states: &mut [&mut Vec<f32>],
    ) -> Result<Vec<f32>> {
        let (n, kd, vd) = (batch.rows(), heads.n_k_heads * heads.d_k, heads.n_v_heads * heads.d_v);
        let width = 2 * kd + vd;
        check_len("delta_rule qkv", qkv.len(), n * width)?;
        let (mut q, mut k) = (gather(qkv, 0, width, n, kd), gather(qkv, kd, width, n, kd));
        let v = gather(qkv, 2 * kd, width, n, vd);
        normalize_qk(&mut q, &mut k, heads.d_k)?;
        let inputs = DeltaRuleInputs { q: &q, k: &k, v: &v, g, beta };
        let mut out = vec![0.0f32; n * vd];
        let mut states: Vec<&mut [f32]> = states.iter_mut().map(|s| s.as_mut_slice()).collect();
        // Prefill takes the chunked form (the reference's prefill path); short runs and decode
        // take the scan, which the chunked form equals to f32 rounding.
        if batch.segments.iter().any(|s| s.len >= DELTA_RULE_CHUNK) {
            delta_rule_chunked(heads, inputs, &batch.segments, &mut states, &mut out)?;
        } else {
            delta_rule_scan(heads, inputs, &batch.segments, &mut states, &mut out)?;
        }
        Ok(out)
    }

    fn gated_rms_norm(&self, y: &Vec<f32>, z: &Vec<f32>, w: &Vec<f32>, eps: f32) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; y.len()];
        gated_rms_norm(y, z, w, eps, &mut out)?;
        Ok(out)
    }

    fn kv_attention(
        &self,
        q: View<Vec<f32>>,
        k: View<Vec<f32>>,
        v: View<Vec<f32>>,
        gate: View<Vec<f32>>,
        batch: &CpuBatch,
        caches: &mut [&mut CpuKv],
        shape: &AttentionShape,
    ) -> Result<Vec<f32>> {
        let (n, qw, kw) = (batch.rows(), shape.q_heads * shape.hd, shape.kv_heads * shape.hd);
        if caches.len() != batch.segments.len() {
            return Err(Error::Shape(format!("kv_attention: {} caches for {} sequences", caches.len(), batch.segments.len())));
        }
        let (q, gate) = (gather(q.buf, q.offset, q.stride, n, qw), gather(gate.buf, gate.offset, gate.stride, n, qw));
        let (k, v) = (gather(k.buf, k.offset, k.stride, n, kw), gather(v.buf, v.offset, v.stride, n, kw));
        let mut out = vec![0.0f32; n * qw];
        for (seg, cache) in batch.segments.iter().zip(caches.iter_mut()) {
            check_len("kv_attention cache width", cache.width, kw)?;
            let past = cache.rows();
            if batch.positions.get(seg.start).is_some_and(|&p| p as usize != past) {
                return Err(Error::Shape(format!("kv_attention: a sequence at position {} has a cache of {past} rows", batch.positions[seg.start])));
            }
            let rows = seg.start..seg.start + seg.len;
            cache.keys.extend_from_slice(&k[rows.start * kw..rows.end * kw]);
            cache.values.extend_from_slice(&v[rows.start * kw..rows.end * kw]);
            causal_attention(&q[rows.start * qw..rows.end * qw], seg.len, past, &cache.keys, &cache.values, shape, &mut out[rows.start * qw..rows.end * qw])?;
        }
        for (o, &g) in out.iter_mut().zip(&gate) {
            *o *= crate::kernels::gated_delta::sigmoid(g);
        }
        Ok(out)
    }

    fn moe(&self, x: &Vec<f32>, d: usize, router_logits: &Vec<f32>, experts: &CpuExperts, top_k: usize) -> Result<Vec<f32>> {
        let Some((gate_up, down, width)) = &experts.shared else {
            return moe_experts(x, d, router_logits, &experts.routed, top_k);
        };
        let ne = experts.routed.len();
        if d == 0 || x.len() % d != 0 {
            return Err(Error::Shape(format!("moe input: {} elements are not rows of {d}", x.len())));
        }
        let rows = x.len() / d;
        check_len("moe router logits", router_logits.len(), rows * (ne + 1))?;
        let mut out = moe_experts(x, d, &gather(router_logits, 0, ne + 1, rows, ne), &experts.routed, top_k)?;
        let act = self.glu(x, rows, gate_up, *width, GatedActivation::Silu)?;
        let y = self.linear(&act, rows, down, None)?;
        for ((o, yr), g) in out.chunks_mut(d).zip(y.chunks(d)).zip(router_logits.chunks(ne + 1)) {
            let s = crate::kernels::gated_delta::sigmoid(g[ne]);
            o.iter_mut().zip(yr).for_each(|(o, &v)| *o += s * v);
        }
        Ok(out)
    }
}

/// Rows `offset + r·stride .. + width` of `x`, packed.
fn gather(x: &[f32], offset: usize, stride: usize, rows: usize, width: usize) -> Vec<f32> {
    (0..rows).flat_map(|r| x[offset + r * stride..offset + r * stride + width].iter().copied()).collect()
}

/// One start position per sequence.
pub fn check_past(segments: &[Segment], past: &[usize]) -> Result<()> {
    if past.len() != segments.len() {
        return Err(Error::Shape(format!("batch: {} start positions for {} sequences", past.len(), segments.len())));
    }
    Ok(())
}

/// Matrix shape of a 2-D weight matrix of any dtype.
pub fn matrix_shape(w: &Matrix) -> Result<(usize, usize)> {
    match w.shape()[..] {
        [out, inp] => Ok((out, inp)),
        _ => Err(Error::Shape(format!("{}: a matrix needs 2 dimensions, the tensor has {:?}", w.name(), w.shape()))),
    }
}

/// [`Ops::linears_conv`] as the ops it is made of (the trait's form, and a backend's where it
/// has nothing better for the shapes at hand).
#[allow(clippy::too_many_arguments)]
pub fn linears_conv_composed<O: Ops>(
    ops: &O,
    x: &O::Buf,
    rows: usize,
    ws: &[&O::Mat],
    (conv, kernel): (&O::Vector, usize),
    channels: usize,
    batch: &O::Batch,
    states: &mut [&mut O::Buf],
) -> Result<Vec<O::Buf>> {
    let mut ys = ops.linears(x, rows, ws)?;
    let first = ys.first().ok_or_else(|| Error::Shape("linears_conv: no product".into()))?;
    ys[0] = ops.conv1d_silu(first, channels, conv, kernel, batch, states)?;
    Ok(ys)
}

/// [`Ops::linear_gelu_mul`] as the ops it is made of (the trait's form, and a backend's where it
/// has nothing better for the shapes at hand).
pub fn linear_gelu_mul_composed<O: Ops>(ops: &O, x: &O::Buf, rows: usize, w: &O::Mat, width: usize, u: View<O::Buf>) -> Result<O::Buf> {
    let g = ops.linear(x, rows, w, None)?;
    ops.gelu_tanh_mul(View::new(&g, 0, width), u, rows, width)
}

/// [`Ops::attention_add_norm_next`] as the ops it is made of (the trait's form, and a
/// backend's where it has nothing better for the shapes at hand).
#[allow(clippy::too_many_arguments)]
pub fn attention_add_norm_next_composed<O: Ops>(
    ops: &O,
    (q, k, v): (View<O::Buf>, View<O::Buf>, View<O::Buf>),
    batch: &O::Batch,
    shape: &AttentionShape,
    rows: usize,
    wo: &O::Mat,
    h: &mut O::Buf,
    SandwichNorm { weight, post, d, eps }: SandwichNorm<O>,
    next: &O::Vector,
    out: &mut O::Buf,
) -> Result<()> {
    let att = ops.attention(q, k, v, batch, shape)?;
    ops.linear_add_norm_next(&att, rows, wo, h, weight, post, d, eps, next, out)
}

/// [`Ops::projected_kv_attention`] as the ops it is made of (the trait's form, and a backend's
/// where it has nothing better for the batch at hand).
pub fn projected_kv_attention_composed<O: Ops>(
    ops: &O,
    y: &mut O::Buf,
    heads: ProjectedHeads<O>,
    batch: &O::Batch,
    caches: &mut [&mut O::Kv],
    shape: &AttentionShape,
) -> Result<O::Buf> {
    let ProjectedHeads { stride, q, gate, k, v, q_prep, k_prep } = heads;
    ops.head_prep(y, stride, batch, &[(q, q_prep), (k, k_prep)])?;
    let view = |offset| View::new(&*y, offset, stride);
    ops.kv_attention(view(q), view(k), view(v), view(gate), batch, caches, shape)
}

/// [`Ops::ffn_add_norm`] as the ops it is made of (the trait's form, and a backend's where it
/// has nothing better for the shapes at hand).
#[allow(clippy::too_many_arguments)]
pub fn ffn_add_norm_composed<O: Ops>(
    ops: &O,
    a: &mut O::Buf,
    rows: usize,
    (gate_up, width, act): (&O::Mat, usize, GatedActivation),
    down: &O::Mat,
    h: &mut O::Buf,
    SandwichNorm { weight, post, d, eps }: SandwichNorm<O>,
    next: Option<&O::Vector>,
) -> Result<()> {
    let g = ops.glu(a, rows, gate_up, width, act)?;
    match next {
        Some(next) => ops.linear_add_norm_next(&g, rows, down, h, weight, post, d, eps, next, a),
        None => {
            let y = ops.linear(&g, rows, down, None)?;
            ops.add_norm(h, &y, weight, post, d, eps)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_rows_gives_equal_rows_or_an_error() {
        let v: Vec<f32> = (0..6).map(|i| i as f32).collect();
        assert_eq!(split_rows(&v, 3).unwrap(), vec![vec![0.0, 1.0], vec![2.0, 3.0], vec![4.0, 5.0]]);
        assert_eq!(split_rows(&v, 1).unwrap(), vec![v.clone()]);
        assert!(matches!(split_rows(&v, 4), Err(Error::Shape(_))));
        assert!(matches!(split_rows(&v, 0), Err(Error::Shape(_))));
        assert_eq!(split_rows(&[], 2).unwrap(), vec![Vec::<f32>::new(); 2]);
        assert!(split_rows(&[], 0).unwrap().is_empty());
    }

    #[test]
    fn views_check_their_bounds() {
        // Rows of 4 from column 1, two wide, fit 12 elements; from column 3 the last row ends past them.
        assert!(check_view("v", 12, 1, 4, 3, 2).is_ok());
        assert!(check_view("v", 12, 3, 4, 3, 2).is_err(), "the last row would end past the buffer");
        assert!(check_view("v", 12, 0, 2, 3, 4).is_err(), "a stride shorter than a row overlaps rows");
        assert!(check_view("v", 0, 0, 0, 0, 4).is_ok(), "no rows need no elements");
    }

    #[test]
    fn cpu_head_prep_on_a_view_leaves_the_rest_of_each_row() {
        let ops = CpuOps;
        let batch = ops.batch(&crate::kernels::pack([2]), &[5, 6]).unwrap();
        let mut x: Vec<f32> = (0..12).map(|v| v as f32 + 1.0).collect();
        let prep = HeadOps::<CpuOps> { heads: 1, hd: 2, norm: Some(None), eps: 0.0, rope: None };
        ops.head_prep(&mut x, 6, &batch, &[(2, prep)]).unwrap();
        // Columns 2..4 of each 6-wide row are RMS-normalised; the others are untouched.
        let inv = |a: f32, b: f32| 1.0 / ((a * a + b * b) / 2.0).sqrt();
        assert_eq!(&x[..2], &[1.0, 2.0]);
        assert!((x[2] - 3.0 * inv(3.0, 4.0)).abs() < 1e-6 && (x[3] - 4.0 * inv(3.0, 4.0)).abs() < 1e-6);
        assert_eq!(&x[4..8], &[5.0, 6.0, 7.0, 8.0]);
        assert!((x[8] - 9.0 * inv(9.0, 10.0)).abs() < 1e-6);
        assert_eq!(&x[10..], &[11.0, 12.0]);
    }
}
