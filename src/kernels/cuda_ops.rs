//! The CUDA backend of the op set: [`Ops`] over device buffers, each op the launcher of its
//! family's CUDA form (`src/kernels/<family>/cuda.rs`, source beside it). Everything is queued
//! on the GPU's one stream; only [`Ops::to_host`] waits.
//!
//! Two precisions ([`Precision`]): f32 (the same maths as the CPU: weights kept as stored, f32
//! products) and bf16 (f32 weights rounded to bf16; GEMM inputs rounded to bf16 for tensor-core
//! GEMMs with f32 accumulation, while few-row products take f32 inputs; activations, norms,
//! attention and the residual stay f32). fp16 is refused: EmbeddingGemma's activations overflow
//! half precision.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::cuda::{driver_err, CudaEvent, CudaSlice, Gpu, KernelSource, StepPool};
use crate::error::{Error, Result};
use crate::formats::Matrix;
use crate::kernels::activation::cuda::ActivationCuda;
use crate::kernels::attention::cuda::{AttentionCuda, GpuAttentionBatch, GpuKv, KvAttentionCuda, KvForm, KvHeadPrep};
use crate::kernels::attention::AttentionShape;
use crate::kernels::backend::{attention_add_norm_next_composed, check_past, ffn_add_norm_composed, gated_delta_in_steps, linear_gelu_mul_composed, linears_conv_composed, projected_kv_attention_composed, split_rows, matrix_shape, GatedActivation, GatedDeltaInputs, HeadOps, Ops, ProjectedHeads, SandwichNorm, View};
use crate::kernels::embedding::cuda::{EmbeddingCuda, GpuIds};
use crate::kernels::gated_delta::cuda::{ChunkAccumulate, FusedGatesNorm, GatedDeltaCuda, GpuDeltaRuleInputs, GpuSegments, GpuStates, Rows, FUSED_MAX_DV};
use crate::kernels::gated_delta::{DeltaRuleHeads, DELTA_RULE_CHUNK};
use crate::kernels::matmul::cuda::{expert_tiles, Blas, GemvOutput, GpuMatrix, GpuMatrixTable, GEMV_MAX_ROWS};
use crate::kernels::matmul::Weights;
use crate::kernels::moe::cuda::{sort_slots_on_host, MoeCuda, SlotOrder, SortedSlots, MAX_DEVICE_EXPERTS, MAX_DEVICE_TOP_K, MAX_SORT_EXPERTS};
use crate::kernels::moe::mlp_shape;
use crate::kernels::norm::cuda::{NormCuda, NormOut};
use crate::kernels::pool::cuda::PoolCuda;
use crate::kernels::rope::cuda::{GpuHeadPrep, GpuRope, RopeCuda};
use crate::kernels::rope::RopeTable;
use crate::kernels::sample::cuda::SelectCuda;
use crate::kernels::sample::{LogitsWant, StepLogits};
use crate::kernels::{check_len, Segment};

/// The CUDA translation units of the op set outside the gated-delta family (which lists its own).
pub const SOURCES: &[KernelSource] = &[
    crate::kernels::norm::cuda::SOURCE,
    crate::kernels::activation::cuda::SOURCE,
    crate::kernels::rope::cuda::SOURCE,
    crate::kernels::attention::cuda::SOURCE,
    crate::kernels::attention::cuda::SOURCE_TC,
    crate::kernels::pool::cuda::SOURCE,
    crate::kernels::embedding::cuda::SOURCE,
    crate::kernels::matmul::cuda::SOURCE,
    crate::kernels::attention::cuda::SOURCE_KV,
    crate::kernels::moe::cuda::SOURCE,
    crate::kernels::sample::cuda::SOURCE,
];

/// Batches of at most this many tokens run as CUDA graphs: at these sizes a forward pass is a
/// few hundred launches of microsecond kernels, and replaying a recorded graph removes the
/// per-launch host overhead that would otherwise dominate (a short query's latency).
pub const GRAPH_MAX_TOKENS: usize = 512;
/// Recorded graphs kept per model (distinct batch shapes); the cache is cleared when full.
const GRAPH_CACHE: usize = 64;

/// A recorded step: its batch (whose ids and positions a replay rewrites) and output buffer,
/// and under TERN_CUDA_PROFILE=graph the event pairs recorded around each of its ops.
struct Recorded {
    batch: CudaBatch,
    graph: cudarc::driver::CudaGraph,
    out: CudaSlice<f32>,
    marks: Vec<OpMark>,
    /// The address tables and scratch buffers the graph reads and writes (see
    /// [`Gpu::address_table`], [`Gpu::hold_while_recorded`]).
    _buffers: Vec<crate::cuda::RecordedBuffer>,
    /// The pool of the buffers the step allocated while it was recorded, if it took one
    /// ([`StepPool`]; a round's is shared with every pooled round, `CudaOps::rounds_pool`):
    /// dropped after the graph and the buffers above (fields drop in order).
    pool: Option<Arc<StepPool>>,
}

/// One op inside a recorded step, between two timing events that are nodes of the graph.
struct OpMark {
    name: &'static str,
    start: CudaEvent,
    end: CudaEvent,
}

/// How TERN_CUDA_PROFILE times ops: `Drained` (any value but `graph`): each op alone, the
/// stream drained before and after it, no graphs, so each op also pays a launch and a sync;
/// `Graph`: inside recorded steps, between event nodes of the graph, so each op is timed in
/// the company it runs in (the event nodes add a little to every op). Plain steps, such as the
/// first of each shape, are not timed in that mode.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ProfileMode {
    Drained,
    Graph,
}

struct Profile {
    mode: ProfileMode,
    /// (calls, seconds) by op name.
    totals: Mutex<HashMap<&'static str, (u64, f64)>>,
    /// The marks of the step being recorded now.
    recording: Mutex<Vec<OpMark>>,
}

// SAFETY: a Recorded is only touched under CudaOps::graphs' lock, by one thread at a time; the
// graph handle has no thread affinity (the driver API takes any thread bound to the context).
unsafe impl Send for Recorded {}

/// Arithmetic of the GEMMs on a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// f32 operands, f32 arithmetic: the reference maths.
    #[default]
    F32,
    /// bf16 weights (Q8_0 kept), bf16 GEMM inputs on tensor cores, f32 accumulation and activations.
    Bf16,
}

impl FromStr for Precision {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" | "float32" => Ok(Precision::F32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "f16" | "fp16" | "float16" | "half" => Err(Error::Input(
                "dtype fp16 is refused: the fast mode is bf16 (EmbeddingGemma's activations overflow half precision); use bf16 or f32".into(),
            )),
            _ => Err(Error::Input(format!("dtype `{s}`: expected f32 or bf16"))),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        })
    }
}

/// An embedding table on the device (always f32: a lookup, not a product).
pub struct GpuTable {
    data: CudaSlice<f32>,
    width: usize,
}

/// A packed batch on the device: the attention tiles, segment bounds and row positions, each
/// sequence's first position, its last row, and its segment for the gated-delta kernels (state
/// slot s for sequence s).
pub struct CudaBatch {
    ids: GpuIds,
    att: GpuAttentionBatch,
    positions: CudaSlice<u32>,
    max_position: usize,
    past: Vec<usize>,
    last_rows: GpuIds,
    gdn: GpuSegments,
}

/// The experts of one MoE layer on the device: gate and up stacked, and down, per expert.
pub struct GpuExperts {
    experts: Vec<(GpuMatrix, GpuMatrix)>,
    /// The shared expert: gate|up, down and its width.
    shared: Option<(GpuMatrix, GpuMatrix, usize)>,
    /// Address tables of the experts' gate|up and down matrices for the device routing of few
    /// rows (None when the matrices do not suit the routed GEMV: the host routing then serves),
    /// the shared expert last where it has the routed experts' shape and type (`shared_routed`).
    routed: Option<(GpuMatrixTable, GpuMatrixTable)>,
    shared_routed: bool,
    width: usize,
    hidden: usize,
}

impl GpuExperts {
    /// Columns of a row of the router's output: the experts' logits, then the shared expert's
    /// gate logit where there is a shared expert.
    fn router_stride(&self) -> usize {
        self.experts.len() + self.shared.is_some() as usize
    }
}

/// Rows an expert averages up to which a prompt's MoE products run as GEMVs over tiles of
/// rows rather than one GEMM per expert ([`CudaOps::moe`]), where the tiles run on the CUDA
/// cores (f32 mode). Measured on Qwen3.5-35B-A3B's first 8 layers (256 experts, top 8; H200,
/// tokens/s of a prompt, tiles against GEMMs): the Q8_0 GGUF's CUDA-core tiles, 16 tokens (0.5
/// rows an expert) 2 347 / 772, 128 (4) 7 749 / 3 071, 512 (16) 11 255 / 12 057; on the BF16
/// GGUF at 2048 tokens (64) 15.9k against 40.3k.
const MOE_TILE_ROWS: usize = 16;
/// The same bound where the tiles run on the tensor cores (fast mode, bf16 or Q8_0 weights): a
/// tensor-core tile of 8 rows costs about what one of 2 does, so tiles stay ahead of the GEMMs
/// far longer. BF16 GGUF, one call: 512 tokens 52.6k / 10.7k; 1024 (32 rows) 64.6k (bound 64) /
/// 18.6k (16); 2048 (64) 73.6k / 47.2k; 4096 (128) 77.6k (bound 128) / 78.4k (GEMMs). Q8_0
/// GGUF: 1024 tokens 34.7k / 17.1k, 2048 38.7k / 32.0k.
const MOE_TILE_ROWS_TENSOR_CORES: usize = 64;
/// MoE steps of at most this many rows sort their slots on the device by default (see
/// `CudaOps::moe_device_sort`): decode rounds of up to 256 sequences, which then record as
/// graphs (the host sort's copy to the host cannot be recorded).
/// Qwen3.5-35B-A3B's first 8 layers, BF16 GGUF, bf16 mode, H200, one call: rounds of 32
/// sequences 13.4k tok/s against 10.9k sorted on the host, 128: 25.3k / 21.3k; sorting every
/// step on the device cost 2048-token prompts 7% (64.4k / 69.3k) and 512-token ones 5%.
const MOE_DEVICE_SORT_MAX_ROWS: usize = 256;

/// A decode step's routed MoE slots ([`CudaOps::routed_slots`]): per row `per_row` slots of
/// expert ids and weights, and each slot's gated activation (rows of the experts' width).
struct RoutedSlots<'a> {
    /// The experts' down matrices (the slots' second product).
    down: &'a GpuMatrixTable,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    act: CudaSlice<f32>,
    per_row: usize,
}

/// The LLM-only kernel families, loaded on first use (an embedding model never compiles them).
struct LlmKernels {
    gdn: GatedDeltaCuda,
    kv: KvAttentionCuda,
    moe: MoeCuda,
    select: SelectCuda,
}

pub struct CudaOps {
    gpu: Arc<Gpu>,
    precision: Precision,
    blas: Blas,
    /// Whether a decode step of one sequence is recorded with its buffers from a pool of its
    /// own, so that its graph holds no memory nodes between its kernels and every dependent
    /// launch keeps its programmatic edge ([`StepPool`]; on unless TERN_STEP_POOL=0). H100,
    /// Qwen3.5-0.8B bf16, same call: decode 1 007.4 / 1 017.7 tok/s against 950.7 / 945.5
    /// (+6.5%), after 512 tokens 979.0 / 976.1 against 915.5 / 911.6.
    ///
    /// Not prompts: a prompt's recording is rarely replayed (a new sequence is a new key) and
    /// takes no dependent launch, so a pool of its own (a stream and fresh memory each) can only
    /// cost it (with every recording pooled a 16-token prompt measured 1 508, 2 653, 2 899 and
    /// 3 289 tok/s against 3 176 and 3 468: noisy, but no gain). Not decode rounds of several
    /// sequences a pool each: a graph's own pool keeps its step's largest buffers for as long as
    /// the graph lives (a round of 128 sequences' logits alone are 127 MB at Qwen3.5's
    /// vocabulary), and a server's rounds change keys often enough to fill the cache of
    /// [`GRAPH_CACHE`] graphs; they share one (`step_pool_rounds`). One sequence's step keeps a
    /// few MB.
    step_pools: bool,
    /// Whether decode rounds of several sequences take a step pool too, one pool shared by
    /// every such recording (`rounds_pool`), so that the memory it keeps is the largest
    /// round's, not one round's per graph (on with step pools, unless TERN_STEP_POOL_ROUNDS=0).
    /// Sharing is safe for the reason a step's own buffers may share one pool: the pool's
    /// buffers are used only by the recorded steps' kernels, and the steps replay one after
    /// another on the one stream, each a full dependency of the next. H100, Qwen3.5-0.8B bf16,
    /// two pairs in one call (2026-12-06, BENCHMARKS.md, twenty-fifth session): rounds of 8 /
    /// 32 / 128 sequences 6 242 / 13 696 / 28 628 and 6 260 / 13 694 / 28 561 tok/s against
    /// 6 043 / 13 422 / 28 363 and 6 037 / 13 421 / 28 391 (+3.5%, +2.0%, +0.8%); one
    /// sequence level.
    step_pool_rounds: bool,
    /// Whether a decode step's attention prepares its q and k heads itself (PREP in
    /// attention/kv.cu: one launch a layer fewer, the same bits), unless TERN_KV_PREP=0. H100,
    /// Qwen3.5-0.8B bf16, two pairs in one call: decode 1 110.3 / 1 112.8 tok/s against
    /// 1 102.3 / 1 110.3, after 512 tokens 1 068.6 / 1 070.9 against 1 056.1 / 1 059.4 (+1.1%),
    /// rounds of 8 sequences +1%, of 32 and 128 level (BENCHMARKS.md, twenty-fifth session).
    kv_prep: bool,
    rounds_pool: Mutex<Option<Arc<StepPool>>>,
    norm: NormCuda,
    activation: ActivationCuda,
    rope: RopeCuda,
    attention: AttentionCuda,
    pool: PoolCuda,
    embedding: EmbeddingCuda,
    llm: OnceLock<LlmKernels>,
    /// Bytes of weights uploaded so far.
    weight_bytes: AtomicUsize,
    /// A prompt's MoE products take GEMVs over tiles of each expert's rows while its experts
    /// average at most [`MOE_TILE_ROWS`] rows ([`MOE_TILE_ROWS_TENSOR_CORES`] for tiles on the
    /// tensor cores), else one GEMM per expert. TERN_MOE_TILE_ROWS sets one bound for both, to
    /// measure the two forms on the same run.
    moe_tile_rows: Option<usize>,
    /// Whether a one-row decode step's MoE ends in one launch with the residual step and the
    /// norm ([`Ops::moe_residual_norm`]); TERN_MOE_FUSED_RESIDUAL=0 turns it off, to measure the
    /// two forms on the same run.
    moe_fused_residual: bool,
    /// Whether a MoE step of more rows than a decode step routes slot by slot sorts its slots
    /// on the device where the tiles serve ([`MoeCuda::sort_slots`]), so that nothing returns
    /// to the host and a decode round of many sequences can be recorded as a graph: `None`
    /// (the default, and any other value of TERN_MOE_DEVICE_SORT) for steps of at most
    /// [`MOE_DEVICE_SORT_MAX_ROWS`] rows, else always (TERN_MOE_DEVICE_SORT=1) or never (=0).
    moe_device_sort: Option<bool>,
    /// Whether, where a product reads bf16 rows (fast mode's tensor-core GEMMs: prompts and
    /// documents), the op before it writes them as bf16 straight: a feed-forward block's gated
    /// activation for its down product ([`Ops::ffn_add_norm`]) and the attention for its output
    /// projection ([`Ops::attention_add_norm_next`]), sparing the f32 rows' write and the
    /// conversion pass (the same bits). On by default: on the H200 it took EmbeddingGemma 2's 64
    /// documents of 512 tokens from 57.2 to 53.4 ms in bf16 mode (BENCHMARKS.md, 2026-12-05);
    /// TERN_BF16_ROWS=0 turns it off, to measure the two forms in one run.
    bf16_rows: bool,
    /// How decode attention spreads a row's keys over blocks and warps ([`KvForm::from_env`]).
    kv_form: KvForm,
    /// cuBLAS handles are not thread-safe and forward passes share the stream: one at a time.
    exclusive: Mutex<()>,
    /// Recorded steps by their keys (Err: recording failed, run plainly).
    graphs: Mutex<HashMap<Vec<u64>, std::result::Result<Recorded, String>>>,
    /// Per-op device time when TERN_CUDA_PROFILE is set (see [`CudaOps::take_op_profile`]).
    profile: Option<Profile>,
}

/// Times one op for the profile. Drained: the stream is drained when it starts and when it
/// ends, so the host clock between covers exactly the op's device work (plus a launch and a
/// sync). Graph: while a step is being recorded, an event node before and after the op.
struct OpTimer<'a> {
    ops: &'a CudaOps,
    name: &'static str,
    start: Option<std::time::Instant>,
    start_event: Option<CudaEvent>,
}

impl Drop for OpTimer<'_> {
    fn drop(&mut self) {
        let Some(profile) = &self.ops.profile else { return };
        // Failures below surface again at the op's next call; the profile only measures.
        if let Some(start) = self.start {
            let _ = self.ops.gpu.synchronize();
            let mut p = profile.totals.lock().unwrap_or_else(|p| p.into_inner());
            let e = p.entry(self.name).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += start.elapsed().as_secs_f64();
        }
        if let Some(start) = self.start_event.take() {
            if let Ok(end) = self.ops.graph_event() {
                profile.recording.lock().unwrap_or_else(|p| p.into_inner()).push(OpMark { name: self.name, start, end });
            }
        }
    }
}

impl CudaOps {
    /// These ops with bf16 rows handed to the products that read them (`true`) or not,
    /// whatever TERN_BF16_ROWS says: the device tests compare the two.
    #[cfg(test)]
    pub(crate) fn with_bf16_rows(mut self, on: bool) -> Self {
        self.bf16_rows = on;
        self
    }

    /// These ops recording decode steps with their buffers from a pool of their own (`true`) or
    /// from the stream, whatever TERN_STEP_POOL says: the device test compares the two.
    #[cfg(test)]
    pub(crate) fn with_step_pools(mut self, on: bool) -> Self {
        self.step_pools = on;
        self
    }

    /// These ops with decode attention preparing its heads itself or not, whatever TERN_KV_PREP
    /// says: the device test compares them.
    #[cfg(test)]
    pub(crate) fn with_kv_prep(mut self, on: bool) -> Self {
        self.kv_prep = on;
        self
    }

    /// These ops recording decode rounds of several sequences with their buffers from the
    /// shared rounds pool (`true`, with step pools on) or not, whatever TERN_STEP_POOL_ROUNDS
    /// says: the device test compares them.
    #[cfg(test)]
    pub(crate) fn with_step_pool_rounds(mut self, on: bool) -> Self {
        self.step_pool_rounds = on;
        self
    }

    /// The pool every pooled round is recorded with, made at the first (see
    /// `step_pool_rounds`); None where the driver has no pools of one's own.
    fn rounds_pool(&self) -> Option<Arc<StepPool>> {
        let mut shared = self.rounds_pool.lock().unwrap_or_else(|p| p.into_inner());
        if shared.is_none() {
            *shared = self.gpu.step_pool().ok().map(Arc::new);
        }
        shared.clone()
    }

    /// These ops with decode attention in `form`, whatever TERN_KV_SPLITS and TERN_KV_WARPS
    /// say: the device test runs every form. Before the first LLM op (which builds its kernels).
    #[cfg(test)]
    pub(crate) fn with_kv_form(mut self, form: KvForm) -> Self {
        self.kv_form = form;
        self
    }

    /// These ops with a prompt's MoE slots sorted on the device (`true`) or on the host: the
    /// device test runs both, whatever TERN_MOE_DEVICE_SORT says.
    #[cfg(test)]
    pub(crate) fn with_moe_device_sort(mut self, on: bool) -> Self {
        self.moe_device_sort = Some(on);
        self
    }

    /// The first half of a MoE layer on few rows (a decode step), on the device: the rows'
    /// routing and each slot's silu(gate)·up straight from its gate|up product, the shared
    /// expert being each row's last slot where it shares the tables. None where the layer does
    /// not take that form (many rows, or experts the routed GEMV or the routing kernel do not
    /// take). The router's output is [rows][stride], the experts' logits first.
    fn routed_slots<'e>(&self, x: &CudaSlice<f32>, rows: usize, router_logits: &CudaSlice<f32>, experts: &'e GpuExperts, top_k: usize) -> Result<Option<RoutedSlots<'e>>> {
        let ne = experts.experts.len();
        let Some((gate_up, down)) = &experts.routed else { return Ok(None) };
        if rows > GEMV_MAX_ROWS || top_k > MAX_DEVICE_TOP_K || top_k > ne {
            return Ok(None);
        }
        let stride = experts.router_stride();
        let per_row = top_k + experts.shared_routed as usize;
        let slots = rows * per_row;
        let (mut ids, mut weights) = (self.gpu.alloc::<i32>(slots)?, self.gpu.alloc::<f32>(slots)?);
        self.llm()?.moe.route(router_logits, ne, stride, top_k, experts.shared_routed, &mut ids, &mut weights)?;
        let mut act = self.gpu.alloc::<f32>(slots * experts.width)?;
        self.blas.routed(gate_up, &ids, slots, x, per_row, GemvOutput::Silu, &mut act)?;
        Ok(Some(RoutedSlots { down, ids, weights, act, per_row }))
    }

    /// out += sigmoid(gate)·shared(x) for a MoE layer's `rows` rows, the shared expert as a
    /// dense MLP (a prompt's rows, or a shared expert of another shape than the routed ones),
    /// its gate logit the router's last column.
    fn add_shared_expert(&self, x: &CudaSlice<f32>, rows: usize, router_logits: &CudaSlice<f32>, experts: &GpuExperts, out: &mut CudaSlice<f32>) -> Result<()> {
        let Some((gate_up, down, width)) = &experts.shared else { return Ok(()) };
        let act = self.glu(x, rows, gate_up, *width, GatedActivation::Silu)?;
        let y = self.linear(&act, rows, down, None)?;
        let ne = experts.experts.len();
        let _timer = self.op_timer("add_sigmoid_gated");
        self.llm()?.moe.add_sigmoid_gated(out, &y, router_logits, ne, experts.router_stride(), experts.hidden)
    }

    /// Compiles (through the cache) and loads every encoder kernel on `gpu`.
    pub fn new(gpu: Arc<Gpu>, precision: Precision) -> Result<Self> {
        Ok(CudaOps {
            blas: Blas::new(gpu.clone(), precision == Precision::Bf16)?,
            step_pools: std::env::var("TERN_STEP_POOL").map_or(true, |v| v != "0"),
            step_pool_rounds: std::env::var("TERN_STEP_POOL_ROUNDS").map_or(true, |v| v != "0"),
            kv_prep: std::env::var("TERN_KV_PREP").map_or(true, |v| v != "0"),
            rounds_pool: Mutex::new(None),
            norm: NormCuda::new(gpu.clone())?,
            activation: ActivationCuda::new(gpu.clone())?,
            rope: RopeCuda::new(gpu.clone())?,
            attention: AttentionCuda::new(gpu.clone())?,
            pool: PoolCuda::new(gpu.clone())?,
            embedding: EmbeddingCuda::new(gpu.clone())?,
            llm: OnceLock::new(),
            gpu,
            precision,
            weight_bytes: AtomicUsize::new(0),
            moe_fused_residual: std::env::var("TERN_MOE_FUSED_RESIDUAL").map_or(true, |v| v != "0"),
            moe_device_sort: match std::env::var("TERN_MOE_DEVICE_SORT").as_deref() {
                Ok("1") => Some(true),
                Ok("0") => Some(false),
                _ => None,
            },
            moe_tile_rows: std::env::var("TERN_MOE_TILE_ROWS").ok().and_then(|v| v.parse().ok()),
            bf16_rows: std::env::var("TERN_BF16_ROWS").map_or(true, |v| v != "0"),
            kv_form: KvForm::from_env(),
            exclusive: Mutex::new(()),
            graphs: Mutex::new(HashMap::new()),
            profile: std::env::var_os("TERN_CUDA_PROFILE").map(|v| Profile {
                mode: if v == "graph" { ProfileMode::Graph } else { ProfileMode::Drained },
                totals: Mutex::new(HashMap::new()),
                recording: Mutex::new(Vec::new()),
            }),
        })
    }

    /// With TERN_CUDA_PROFILE set, each op's device time is summed by name (see
    /// [`ProfileMode`]; `graph` also adds a `(step)` row, each replayed step whole, the sum the
    /// ops' rows fall short of by the gaps between them): a development view of where a
    /// forward pass spends its device time. Returns `(op, calls, seconds)` since the last call,
    /// slowest first, and clears it (so that phases can be profiled one after another); None
    /// when not profiling.
    pub fn take_op_profile(&self) -> Option<Vec<(&'static str, u64, f64)>> {
        let mut p = self.profile.as_ref()?.totals.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> = p.drain().map(|(k, (n, t))| (k, n, t)).collect();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        Some(v)
    }

    fn op_timer(&self, name: &'static str) -> OpTimer<'_> {
        let mut timer = OpTimer { ops: self, name, start: None, start_event: None };
        match self.profile.as_ref().map(|p| p.mode) {
            Some(ProfileMode::Drained) => {
                let _ = self.gpu.synchronize();
                timer.start = Some(std::time::Instant::now());
            }
            Some(ProfileMode::Graph) if self.recording() => timer.start_event = self.graph_event().ok(),
            _ => {}
        }
        timer
    }

    /// Whether the stream is recording a step now.
    fn recording(&self) -> bool {
        self.gpu.recording().unwrap_or(false)
    }

    /// A timing event recorded on the stream as a node of the graph being captured (an
    /// "external" record: a plain one inside a capture only orders work, it keeps no time).
    fn graph_event(&self) -> Result<CudaEvent> {
        let event = self.gpu.event()?;
        // SAFETY: the event and stream are live handles of this context.
        let status = unsafe {
            cudarc::driver::sys::cuEventRecordWithFlags(
                event.cu_event(),
                self.gpu.stream().cu_stream(),
                cudarc::driver::sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32,
            )
        };
        status.result().map_err(driver_err("recording a timing event in a graph"))?;
        Ok(event)
    }

    /// Adds a replayed step's op times (TERN_CUDA_PROFILE=graph), after waiting for it.
    fn add_step_profile(&self, marks: &[OpMark], step: (&CudaEvent, &CudaEvent)) -> Result<()> {
        let Some(profile) = &self.profile else { return Ok(()) };
        step.1.synchronize().map_err(driver_err("waiting for a profiled step"))?;
        let mut p = profile.totals.lock().unwrap_or_else(|p| p.into_inner());
        let rows = marks.iter().map(|m| (m.name, &m.start, &m.end)).chain([("(step)", step.0, step.1)]);
        for (name, start, end) in rows {
            let ms = start.elapsed_ms(end).map_err(driver_err("timing a profiled op"))?;
            let e = p.entry(name).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += ms as f64 * 1e-3;
        }
        Ok(())
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Device bytes held by the weights uploaded through this backend.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes.load(Ordering::Relaxed)
    }

    /// `cuda:N <name> (<arch>), <precision>`.
    pub fn describe(&self) -> String {
        format!("cuda:{} {} ({}), {}", self.gpu.ordinal(), self.gpu.name(), self.gpu.arch(), self.precision)
    }

    /// FLOP/s of this backend's GEMM (its precision) on `[m × k]·[k × n]`, median of timed
    /// runs: the roofline that benchmarks report their fraction of.
    pub fn measure_gemm_rate(&self, m: usize, n: usize, k: usize) -> Result<f64> {
        let w = self.blas.matrix(&Weights::F32(&vec![0.01f32; n * k]), n, k)?;
        let x = self.gpu.upload(&vec![0.5f32; m * k])?;
        let mut y = self.gpu.alloc::<f32>(m * n)?;
        let (start, end) = (self.gpu.event()?, self.gpu.event()?);
        let mut times = Vec::new();
        for rep in 0..12 {
            start.record(self.gpu.stream()).map_err(crate::cuda::driver_err("recording an event"))?;
            self.blas.linear(&x, m, &w, &mut y)?;
            end.record(self.gpu.stream()).map_err(crate::cuda::driver_err("recording an event"))?;
            end.synchronize().map_err(crate::cuda::driver_err("waiting for an event"))?;
            let ms = start.elapsed_ms(&end).map_err(crate::cuda::driver_err("timing"))? as f64;
            if rep >= 2 {
                times.push(ms);
            }
        }
        times.sort_by(|a, b| a.total_cmp(b));
        Ok(2.0 * (m * n * k) as f64 / (times[times.len() / 2] * 1e-3))
    }

    /// Bytes per second of a device-to-device copy of `bytes` (read + written), median of timed
    /// runs: the memory roofline of decode.
    pub fn measure_copy_bandwidth(&self, bytes: usize) -> Result<f64> {
        let n = bytes / 4;
        let src = self.gpu.zeros::<f32>(n)?;
        let mut dst = self.gpu.zeros::<f32>(n)?;
        let (start, end) = (self.gpu.event()?, self.gpu.event()?);
        let mut times = Vec::new();
        for rep in 0..10 {
            start.record(self.gpu.stream()).map_err(crate::cuda::driver_err("recording an event"))?;
            self.gpu.copy(&src, &mut dst)?;
            end.record(self.gpu.stream()).map_err(crate::cuda::driver_err("recording an event"))?;
            end.synchronize().map_err(crate::cuda::driver_err("waiting for an event"))?;
            if rep >= 2 {
                times.push(start.elapsed_ms(&end).map_err(crate::cuda::driver_err("timing"))? as f64);
            }
        }
        times.sort_by(|a, b| a.total_cmp(b));
        Ok(2.0 * (4 * n) as f64 / (times[times.len() / 2] * 1e-3))
    }

    /// Forward passes recorded as CUDA graphs so far, and the recording failures (each with
    /// its error).
    pub fn graph_stats(&self) -> (usize, Vec<String>) {
        let graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        let recorded = graphs.values().filter(|g| g.is_ok()).count();
        (recorded, graphs.values().filter_map(|g| g.as_ref().err().cloned()).collect())
    }

    /// The nodes and edges of each recorded step kept now that took its buffers from a pool of
    /// its own ([`StepPool`], [`crate::cuda::graph_summary`]).
    pub fn pooled_graph_summaries(&self) -> Vec<std::result::Result<crate::cuda::GraphSummary, String>> {
        let graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        graphs.values().filter_map(|g| g.as_ref().ok()).filter(|r| r.pool.is_some()).map(|r| crate::cuda::graph_summary(r.graph.cu_graph())).collect()
    }

    fn count(&self, bytes: usize) {
        self.weight_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn upload_f32(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        self.count(4 * v.len());
        self.gpu.upload(v)
    }

    fn out(f32: &mut CudaSlice<f32>) -> NormOut<'_> {
        NormOut { f32: Some(f32), bf16: None }
    }

    /// Whether a gated-delta layer's step is one token of one sequence (`rows` rows, one conv
    /// state each): its input products then run as one launch with their conv.
    fn one_token(&self, batch: &CudaBatch, rows: usize, states: &[&mut CudaSlice<f32>]) -> bool {
        matches!(self.segments(batch), [s] if s.len == 1) && rows == 1 && states.len() == 1
    }

    /// One row: the residual step of `step` with no norm tail, then the product through `next`
    /// in `output`'s form, whose blocks form the norm (`Blas::linear_residual_norm_then`); its
    /// output, or `None`, nothing queued, where that form does not apply (the caller then runs
    /// the two).
    fn normed_product(
        &self,
        step: NormedStep<'_>,
        x: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        next: &GpuMatrix,
        output: GemvOutput,
    ) -> Result<Option<CudaSlice<f32>>> {
        let NormedStep { residual: (v, rows, w), norm, d, eps, what } = step;
        if rows != 1 || w.out != d || !self.blas.takes_normed_product(w, next, output) {
            return Ok(None);
        }
        let _timer = self.op_timer(what);
        let mut y = self.gpu.alloc::<f32>(output.features(next))?;
        Ok(self.blas.linear_residual_norm_then(v, w, x, norm, eps, out, next, output, &mut y)?.then_some(y))
    }

    /// One row's outputs of the products through `ws`.
    fn one_row_outputs(&self, ws: &[&GpuMatrix]) -> Result<Vec<CudaSlice<f32>>> {
        ws.iter().map(|w| self.gpu.alloc::<f32>(w.out)).collect()
    }

    fn llm(&self) -> Result<&LlmKernels> {
        if let Some(k) = self.llm.get() {
            return Ok(k);
        }
        let k = LlmKernels {
            gdn: GatedDeltaCuda::new(self.gpu.clone())?,
            kv: KvAttentionCuda::new(self.gpu.clone(), self.kv_form)?,
            moe: MoeCuda::new(self.gpu.clone())?,
            select: SelectCuda::new(self.gpu.clone())?,
        };
        // Another thread may have set it meanwhile: either copy is the same kernels.
        let _ = self.llm.set(k);
        Ok(self.llm.get().expect("set just above"))
    }

    /// A weight matrix uploaded in its stored type (f32 as bf16 in the fast mode).
    fn upload_matrix(&self, w: &Matrix) -> Result<GpuMatrix> {
        let (out, inp) = matrix_shape(w)?;
        let m = self.blas.matrix(&Weights::from(w), out, inp)?;
        self.count(m.bytes());
        Ok(m)
    }
}

/// Whether the delta rule of `batch` takes the sequential scan (the recurrence kernel): no
/// segment as long as a chunk (decode steps, short runs; as on the CPU, prefill takes the
/// chunked form) and a d_k the scan keeps in a warp's registers.
fn takes_scan(heads: &DeltaRuleHeads, batch: &CudaBatch) -> bool {
    short(batch) && matches!(heads.d_k, 32 | 64 | 128 | 256)
}

/// No segment of the batch is as long as a delta-rule chunk.
fn short(batch: &CudaBatch) -> bool {
    batch.att.segments.iter().all(|s| s.len < DELTA_RULE_CHUNK)
}

/// The delta rule's q, k, v as views of the conv output `qkv` (`[rows][q | k | v]`, q and k
/// raw: normalised in the kernels), with the gates (or, `fused`, their raw projections).
fn delta_rule_inputs<'a>(
    qkv: &'a CudaSlice<f32>,
    g: &'a CudaSlice<f32>,
    beta: &'a CudaSlice<f32>,
    heads: &DeltaRuleHeads,
    rows: usize,
    fused: Option<FusedGatesNorm<'a>>,
) -> Result<GpuDeltaRuleInputs<'a>> {
    let kd = heads.n_k_heads * heads.d_k;
    let width = 2 * kd + heads.n_v_heads * heads.d_v;
    check_len("delta_rule qkv", qkv.len(), rows * width)?;
    let at = |offset| Rows { buf: qkv, offset, stride: width };
    Ok(GpuDeltaRuleInputs { q: at(0), k: at(kd), v: at(2 * kd), g, beta, normalize_qk: true, fused })
}

/// A residual step whose norm the product after it may form ([`CudaOps::normed_product`]):
/// `x += v·wᵀ` over `rows` rows, then `rms(x)·norm` over rows of `d`; `what` names the op for
/// the profile.
struct NormedStep<'a> {
    residual: (&'a CudaSlice<f32>, usize, &'a GpuMatrix),
    norm: &'a CudaSlice<f32>,
    d: usize,
    eps: f32,
    what: &'static str,
}

/// The GEMV output form that applies `act` to a gate|up product's halves.
fn gated_output(act: GatedActivation) -> GemvOutput {
    match act {
        GatedActivation::Silu => GemvOutput::Silu,
        GatedActivation::GeluTanh => GemvOutput::GeluTanh,
    }
}

/// Each row's position: sequence s's rows follow its `past[s]`.
fn positions(segments: &[Segment], past: &[usize]) -> Vec<u32> {
    segments.iter().zip(past).flat_map(|(s, &p)| (p..p + s.len).map(|v| v as u32)).collect()
}

/// What [`Ops::head_prep`] does to each head, in the rope launcher's terms.
fn gpu_head_prep<'a>(p: &HeadOps<'a, CudaOps>) -> GpuHeadPrep<'a> {
    GpuHeadPrep { heads: p.heads, hd: p.hd, norm: p.norm, eps: p.eps, rope: p.rope }
}

impl Ops for CudaOps {
    type Buf = CudaSlice<f32>;
    type Mat = GpuMatrix;
    type Vector = CudaSlice<f32>;
    type Table = GpuTable;
    type Rope = GpuRope;
    type Batch = CudaBatch;
    type Kv = GpuKv;
    type Experts = GpuExperts;

    fn matrix(&self, w: Matrix) -> Result<GpuMatrix> {
        self.upload_matrix(&w)
    }

    fn stacked(&self, name: String, parts: Vec<Matrix>) -> Result<GpuMatrix> {
        let mut inp = None;
        for p in &parts {
            let (_, i) = matrix_shape(p)?;
            if *inp.get_or_insert(i) != i {
                return Err(Error::tensor(p.name(), format!("{i} columns cannot stack in {name} under rows of {}", inp.unwrap_or(0))));
            }
        }
        let inp = inp.ok_or_else(|| Error::tensor(&name, "nothing to stack"))?;
        let weights: Vec<Weights> = parts.iter().map(Weights::from).collect();
        let m = self.blas.stacked(&weights, inp)?;
        self.count(m.bytes());
        Ok(m)
    }

    fn experts(&self, experts: Vec<[Matrix; 3]>, shared: Option<[Matrix; 3]>) -> Result<GpuExperts> {
        // An MLP on the device: gate and up stacked into one matrix, and down.
        let upload = |[gate, up, down]: [Matrix; 3]| -> Result<(GpuMatrix, GpuMatrix)> {
            let name = gate.name().to_string();
            Ok((self.stacked(name, vec![gate, up])?, self.upload_matrix(&down)?))
        };
        let (mut width, mut hidden) = (0, 0);
        let mut out = Vec::with_capacity(experts.len());
        for matrices in experts {
            let shape = mlp_shape(&matrices)?;
            if !out.is_empty() && shape != (width, hidden) {
                return Err(Error::tensor(matrices[2].name(), "expert matrices do not fit one MLP shape"));
            }
            (width, hidden) = shape;
            out.push(upload(matrices)?);
        }
        let shared = match shared {
            Some(matrices) => {
                let (w, h) = mlp_shape(&matrices)?;
                if !out.is_empty() && h != hidden {
                    return Err(Error::tensor(matrices[2].name(), "shared expert matrices do not fit the experts' hidden size"));
                }
                let (gate_up, down) = upload(matrices)?;
                Some((gate_up, down, w))
            }
            None => None,
        };
        // The routed GEMVs' address tables of the experts, and `extra` after them.
        let tables = |extra: Option<&(GpuMatrix, GpuMatrix, usize)>| -> Result<Option<(GpuMatrixTable, GpuMatrixTable)>> {
            let gate_ups: Vec<&GpuMatrix> = out.iter().map(|(gu, _)| gu).chain(extra.map(|s| &s.0)).collect();
            let downs: Vec<&GpuMatrix> = out.iter().map(|(_, d)| d).chain(extra.map(|s| &s.1)).collect();
            Ok(match (self.blas.matrix_table(&gate_ups)?, self.blas.matrix_table(&downs)?) {
                (Some(gu), Some(d)) if out.len() <= MAX_DEVICE_EXPERTS => Some((gu, d)),
                _ => None,
            })
        };
        // The shared expert joins the tables where it has the routed experts' shape (and their
        // storage type: the tables' own check); a decode step then runs it as one more slot.
        let with_shared = match &shared {
            Some(s) if s.2 == width && !out.is_empty() => tables(Some(s))?,
            _ => None,
        };
        let shared_routed = with_shared.is_some();
        let routed = if shared_routed { with_shared } else { tables(None)? };
        Ok(GpuExperts { experts: out, shared, routed, shared_routed, width, hidden })
    }

    fn vector(&self, v: Vec<f32>) -> Result<CudaSlice<f32>> {
        self.upload_f32(&v)
    }

    fn table(&self, t: Matrix) -> Result<GpuTable> {
        let (_, width) = matrix_shape(&t)?;
        Ok(GpuTable { data: self.upload_f32(&Weights::from(&t).to_f32(width)?)?, width })
    }

    fn rope(&self, t: RopeTable) -> Result<GpuRope> {
        self.count(8 * t.cos().len());
        GpuRope::new(&self.gpu, &t)
    }

    fn batch_at(&self, segments: &[Segment], ids: &[u32], past: &[usize]) -> Result<CudaBatch> {
        check_past(segments, past)?;
        let att = GpuAttentionBatch::new(&self.gpu, segments)?;
        if ids.len() != att.rows {
            return Err(Error::Shape(format!("batch: {} ids for segments covering {} rows", ids.len(), att.rows)));
        }
        let positions = positions(segments, past);
        let max_position = segments.iter().zip(past).map(|(s, &p)| (p + s.len).saturating_sub(1)).max().unwrap_or(0);
        let last: Vec<u32> = segments.iter().filter(|s| s.len > 0).map(|s| (s.start + s.len - 1) as u32).collect();
        let slots: Vec<usize> = (0..segments.len()).collect();
        Ok(CudaBatch {
            ids: GpuIds::new(&self.gpu, ids)?,
            positions: self.gpu.upload(&positions)?,
            att,
            max_position,
            past: past.to_vec(),
            last_rows: GpuIds::new(&self.gpu, &last)?,
            gdn: GpuSegments::new(&self.gpu, segments, &slots, ids.len())?,
        })
    }

    fn zeros(&self, len: usize) -> Result<CudaSlice<f32>> {
        self.gpu.zeros(len)
    }

    fn kv_cache(&self, width: usize) -> Result<GpuKv> {
        GpuKv::new(&self.gpu, width)
    }

    fn segments<'b>(&self, batch: &'b CudaBatch) -> &'b [Segment] {
        &batch.att.segments
    }

    fn kv_reserve(&self, kv: &mut GpuKv, filled: usize, need: usize) -> Result<()> {
        kv.reserve(&self.gpu, filled, need)
    }

    fn buf_handle(&self, b: &CudaSlice<f32>) -> u64 {
        self.gpu.ptr(b)
    }

    fn kv_handle(&self, kv: &GpuKv) -> [u64; 3] {
        kv.handle(&self.gpu)
    }

    fn run_step<R>(
        &self,
        segments: &[Segment],
        ids: &[u32],
        past: &[usize],
        key: Option<&[u64]>,
        f: &mut dyn FnMut(&CudaBatch) -> Result<CudaSlice<f32>>,
        read: &dyn Fn(&CudaSlice<f32>) -> Result<R>,
    ) -> Result<R> {
        // Between steps: a plain run and the recording after it must see the same tables.
        self.gpu.trim_address_tables();
        // One token a sequence: a decode step, whose launches take dependent launch by default
        // (DependentLaunch in cuda/mod.rs), recorded or not.
        let decode_launches = (key.is_some() && segments.iter().all(|s| s.len == 1)).then(|| self.gpu.decode_step());
        let mut plain = || -> Result<R> {
            let batch = self.batch_at(segments, ids, past)?;
            let y = f(&batch)?;
            read(&y)
        };
        let key = match key {
            Some(k)
                if ids.len() <= GRAPH_MAX_TOKENS
                    && self.profile.as_ref().is_none_or(|p| p.mode == ProfileMode::Graph)
                    && std::env::var_os("TERN_NO_CUDA_GRAPHS").is_none() =>
            {
                k
            }
            _ => return plain(),
        };
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        match graphs.get_mut(key) {
            Some(Ok(r)) => {
                if r.batch.att.segments != segments {
                    return Err(Error::Shape("a recorded step replayed with other segments under the same key".into()));
                }
                // The only inputs that change between steps of one key.
                r.batch.ids.write(&self.gpu, ids)?;
                self.gpu.write(&positions(segments, past), &mut r.batch.positions)?;
                if r.marks.is_empty() {
                    r.graph.launch().map_err(driver_err("launching a recorded step"))?;
                } else {
                    let (start, end) = (self.gpu.event()?, self.gpu.event()?);
                    start.record(self.gpu.stream()).map_err(driver_err("recording an event"))?;
                    r.graph.launch().map_err(driver_err("launching a recorded step"))?;
                    end.record(self.gpu.stream()).map_err(driver_err("recording an event"))?;
                    self.add_step_profile(&r.marks, (&start, &end))?;
                }
                return read(&r.out);
            }
            Some(Err(_)) => {
                drop(graphs);
                return plain();
            }
            None => {}
        }
        // First step of this key: run it plainly (which also loads every kernel and lets
        // cuBLAS set up its workspace), then record the same work for the next one. Recording
        // queues nothing that runs now, so the step's effects on its buffers happen once.
        let batch = self.batch_at(segments, ids, past)?;
        let y = f(&batch)?;
        let host = read(&y)?;
        let mut out = self.gpu.alloc::<f32>(y.len())?;
        drop(y);
        if graphs.len() >= GRAPH_CACHE {
            graphs.clear();
        }
        let stream = self.gpu.stream();
        self.gpu.take_recorded_buffers();
        // Where the driver has no pools of one's own, the step is recorded as captured, memory
        // nodes and all.
        let pool = match (self.step_pools && decode_launches.is_some(), segments.len()) {
            (false, _) => None,
            (true, 1) => self.gpu.step_pool().ok().map(Arc::new),
            (true, _) if self.step_pool_rounds => self.rounds_pool(),
            (true, _) => None,
        };
        self.gpu.allocate_from(pool.as_deref());
        // A pool's allocations, on its own uncaptured stream, are calls the driver refuses
        // from a thread that is capturing in its own or the global mode
        // (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, measured on an H100): relaxed mode lets them
        // through. Host copies inside a recording are refused by `Gpu` itself either way.
        use cudarc::driver::sys::CUstreamCaptureMode as Mode;
        let mode = if pool.is_some() { Mode::CU_STREAM_CAPTURE_MODE_RELAXED } else { Mode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL };
        let recorded = stream
            .begin_capture(mode)
            .map_err(driver_err("starting a graph capture"))
            .and_then(|()| {
                // Whatever happens inside, the capture must end, or the stream stays in it.
                let queued = f(&batch).and_then(|y| self.gpu.copy(&y, &mut out));
                let graph = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0)).map_err(driver_err("ending a graph capture"));
                queued.and(graph)
            });
        self.gpu.allocate_from(None);
        let marks = self.profile.as_ref().map(|p| std::mem::take(&mut *p.recording.lock().unwrap_or_else(|p| p.into_inner()))).unwrap_or_default();
        let held = self.gpu.take_recorded_buffers();
        if let (Ok(Some(graph)), Some(_)) = (&recorded, std::env::var_os("TERN_GRAPH_STATS")) {
            eprintln!("recorded step of {} rows: {}", ids.len(), crate::cuda::graph_stats(graph.cu_graph()));
        }
        let entry = match recorded {
            Ok(Some(graph)) => Ok(Recorded { batch, graph, out, marks, _buffers: held, pool }),
            Ok(None) => Err("the capture recorded no graph".to_string()),
            Err(e) => Err(e.to_string()),
        };
        graphs.insert(key.to_vec(), entry);
        Ok(host)
    }

    fn serialize(&self) -> Option<MutexGuard<'_, ()>> {
        Some(self.exclusive.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn embed(&self, table: &GpuTable, batch: &CudaBatch, scale: f32) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer("embed");
        let mut out = self.gpu.alloc::<f32>(batch.ids.len * table.width)?;
        self.embedding.embed_lookup(&table.data, table.width, &batch.ids, scale, &mut out)?;
        Ok(out)
    }

    fn linear(&self, x: &CudaSlice<f32>, rows: usize, w: &GpuMatrix, bias: Option<&CudaSlice<f32>>) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer(if rows <= GEMV_MAX_ROWS { "linear (gemv)" } else { "linear (gemm)" });
        let mut y = self.gpu.alloc::<f32>(rows * w.out)?;
        self.blas.linear(x, rows, w, &mut y)?;
        if let Some(b) = bias {
            self.blas.add_bias(&mut y, b)?;
        }
        Ok(y)
    }

    fn linears(&self, x: &CudaSlice<f32>, rows: usize, ws: &[&GpuMatrix]) -> Result<Vec<CudaSlice<f32>>> {
        let _timer = self.op_timer(if rows <= GEMV_MAX_ROWS { "linears (gemv)" } else { "linears (gemm)" });
        let mut ys = ws.iter().map(|w| self.gpu.alloc::<f32>(rows * w.out)).collect::<Result<Vec<_>>>()?;
        let mut parts: Vec<(&GpuMatrix, &mut CudaSlice<f32>)> = ws.iter().copied().zip(ys.iter_mut()).collect();
        self.blas.linears(x, rows, &mut parts)?;
        Ok(ys)
    }

    fn linears_conv(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        ws: &[&GpuMatrix],
        conv: (&CudaSlice<f32>, usize),
        channels: usize,
        batch: &CudaBatch,
        states: &mut [&mut CudaSlice<f32>],
    ) -> Result<Vec<CudaSlice<f32>>> {
        // A decode step of one sequence: the products and the conv of the first one's channels
        // in one launch (one launch and the conv kernel's two waits fewer a gated-delta layer).
        if self.one_token(batch, rows, states) && ws.first().is_some_and(|w| w.out == channels) {
            let _timer = self.op_timer("linears_conv (gemv)");
            let mut ys = self.one_row_outputs(ws)?;
            let mut parts: Vec<(&GpuMatrix, &mut CudaSlice<f32>)> = ws.iter().copied().zip(ys.iter_mut()).collect();
            if self.blas.linears_conv(x, rows, &mut parts, conv, &mut *states[0])? {
                return Ok(ys);
            }
        }
        linears_conv_composed(self, x, rows, ws, conv, channels, batch, states)
    }

    fn linear_gelu_mul(&self, x: &CudaSlice<f32>, rows: usize, w: &GpuMatrix, width: usize, u: View<CudaSlice<f32>>) -> Result<CudaSlice<f32>> {
        // A query's few rows on the tensor cores: the gelu and the product with u as the GEMV
        // writes (one launch fewer each EmbeddingGemma 2 layer).
        if w.out == width {
            let _timer = self.op_timer("linear_gelu_mul (gemv)");
            let mut y = self.gpu.alloc::<f32>(rows * width)?;
            if self.blas.linear_gelu_by(x, rows, w, u, &mut y)? {
                return Ok(y);
            }
        }
        linear_gelu_mul_composed(self, x, rows, w, width, u)
    }

    fn glu(&self, x: &CudaSlice<f32>, rows: usize, gate_up: &GpuMatrix, width: usize, act: GatedActivation) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer(if rows <= GEMV_MAX_ROWS { "glu (gemv)" } else { "glu (gemm)" });
        if gate_up.out != 2 * width {
            return Err(Error::Shape(format!("glu: halves of {width} from a matrix of {} rows", gate_up.out)));
        }
        let mut y = self.gpu.alloc::<f32>(rows * width)?;
        self.blas.glu(x, rows, gate_up, gated_output(act), &mut y, |gu, y| {
            self.activation.gated_mul(act, View::new(gu, 0, 2 * width), View::new(gu, width, 2 * width), rows, width, Self::out(y))
        })?;
        Ok(y)
    }

    fn rms_norm(&self, x: &CudaSlice<f32>, d: usize, w: Option<&CudaSlice<f32>>, pre: f32, eps: f32) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer("rms_norm");
        let mut y = self.gpu.alloc::<f32>(x.len())?;
        self.norm.rms_norm(x, d, w, pre, eps, Self::out(&mut y))?;
        Ok(y)
    }

    fn add_norm(&self, h: &mut CudaSlice<f32>, y: &CudaSlice<f32>, w: &CudaSlice<f32>, post: f32, d: usize, eps: f32) -> Result<()> {
        let _timer = self.op_timer("add_norm");
        self.norm.add_norm(h, y, w, post, d, eps, None)
    }

    fn add_norm_next(
        &self,
        h: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        post: f32,
        d: usize,
        eps: f32,
        next: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let _timer = self.op_timer("add_norm");
        self.norm.add_norm(h, y, w, post, d, eps, Some((next, Self::out(out))))
    }

    fn linear_add_norm_next(
        &self,
        v: &CudaSlice<f32>,
        rows: usize,
        w: &GpuMatrix,
        h: &mut CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        post: f32,
        d: usize,
        eps: f32,
        next: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        // One row: one GEMV launch whose last block normalises (the same bits as the two).
        if w.out == d && self.blas.norm_tail_fits(rows, w) {
            let _timer = self.op_timer("linear_add_norm (gemv)");
            let mut y = self.gpu.alloc::<f32>(rows * w.out)?;
            if self.blas.linear_add_norm_next(v, rows, w, &mut y, h, norm, post, eps, next, out)? {
                return Ok(());
            }
        }
        let y = self.linear(v, rows, w, None)?;
        self.add_norm_next(h, &y, norm, post, d, eps, next, out)
    }

    fn ffn_add_norm(
        &self,
        a: &mut CudaSlice<f32>,
        rows: usize,
        (gate_up, width, act): (&GpuMatrix, usize, GatedActivation),
        down: &GpuMatrix,
        h: &mut CudaSlice<f32>,
        norm: SandwichNorm<Self>,
        next: Option<&CudaSlice<f32>>,
    ) -> Result<()> {
        // The activation writes bf16 rows straight for the down product when both products are
        // the tensor-core GEMMs that would round their input rows to bf16 anyway; otherwise
        // the composed ops, as the trait's form.
        let handoff = self.bf16_rows && gate_up.out == 2 * width && self.blas.takes_bf16_rows(rows, gate_up) && self.blas.takes_bf16_rows(rows, down);
        if !handoff {
            return ffn_add_norm_composed(self, a, rows, (gate_up, width, act), down, h, norm, next);
        }
        let SandwichNorm { weight, post, d, eps } = norm;
        let _timer = self.op_timer("ffn (gemm, bf16 rows)");
        let mut gu = self.gpu.alloc::<f32>(rows * gate_up.out)?;
        self.blas.linear(a, rows, gate_up, &mut gu)?;
        let mut g16 = self.gpu.alloc::<u16>(rows * width)?;
        let (g, u) = (View::new(&gu, 0, 2 * width), View::new(&gu, width, 2 * width));
        self.activation.gated_mul(act, g, u, rows, width, NormOut { f32: None, bf16: Some(&mut g16) })?;
        drop(gu);
        let mut y = self.gpu.alloc::<f32>(rows * d)?;
        self.blas.linear_bf16(&g16, rows, down, &mut y)?;
        drop(g16);
        self.norm.add_norm(h, &y, weight, post, d, eps, next.map(|n| (n, Self::out(a))))
    }

    fn gelu_tanh_mul(&self, g: View<CudaSlice<f32>>, u: View<CudaSlice<f32>>, rows: usize, width: usize) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer("gelu_tanh_mul");
        let mut out = self.gpu.alloc::<f32>(rows * width)?;
        self.activation.gelu_tanh_mul(g, u, rows, width, Self::out(&mut out))?;
        Ok(out)
    }

    fn head_prep(&self, x: &mut CudaSlice<f32>, stride: usize, batch: &CudaBatch, sections: &[(usize, HeadOps<Self>)]) -> Result<()> {
        let _timer = self.op_timer("head_prep");
        let sections: Vec<(usize, GpuHeadPrep)> = sections.iter().map(|(offset, p)| (*offset, gpu_head_prep(p))).collect();
        self.rope.head_prep(x, stride, batch.att.rows, &batch.positions, batch.max_position, &sections)
    }

    fn attention(
        &self,
        q: View<CudaSlice<f32>>,
        k: View<CudaSlice<f32>>,
        v: View<CudaSlice<f32>>,
        batch: &CudaBatch,
        shape: &AttentionShape,
    ) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer("attention");
        let mut out = self.gpu.alloc::<f32>(batch.att.rows * shape.q_heads * shape.hd)?;
        match self.precision {
            Precision::F32 => self.attention.attention(q, k, v, &batch.att, shape, Self::out(&mut out))?,
            Precision::Bf16 => self.attention.attention_bf16(q, k, v, &batch.att, shape, Self::out(&mut out))?,
        }
        Ok(out)
    }

    fn attention_add_norm_next(
        &self,
        (q, k, v): (View<CudaSlice<f32>>, View<CudaSlice<f32>>, View<CudaSlice<f32>>),
        batch: &CudaBatch,
        shape: &AttentionShape,
        rows: usize,
        wo: &GpuMatrix,
        h: &mut CudaSlice<f32>,
        norm: SandwichNorm<Self>,
        next: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        // Fast mode's attention writes bf16 rows straight for the output projection when that
        // is a tensor-core GEMM, which would round its input rows to bf16 anyway.
        let handoff = self.bf16_rows && rows == batch.att.rows && self.blas.takes_bf16_rows(rows, wo);
        if !handoff {
            return attention_add_norm_next_composed(self, (q, k, v), batch, shape, rows, wo, h, norm, next, out);
        }
        let SandwichNorm { weight, post, d, eps } = norm;
        let _timer = self.op_timer("attention (bf16 rows) + gemm");
        let mut att16 = self.gpu.alloc::<u16>(rows * shape.q_heads * shape.hd)?;
        self.attention.attention_bf16(q, k, v, &batch.att, shape, NormOut { f32: None, bf16: Some(&mut att16) })?;
        let mut y = self.gpu.alloc::<f32>(rows * wo.out)?;
        self.blas.linear_bf16(&att16, rows, wo, &mut y)?;
        drop(att16);
        self.norm.add_norm(h, &y, weight, post, d, eps, Some((next, Self::out(out))))
    }

    fn mean_pool(&self, h: &CudaSlice<f32>, d: usize, batch: &CudaBatch) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer("mean_pool");
        let mut out = self.gpu.alloc::<f32>(batch.att.segments.len() * d)?;
        self.pool.mean_pool(h, d, &batch.att, &mut out)?;
        Ok(out)
    }

    fn to_host(&self, x: &CudaSlice<f32>) -> Result<Vec<f32>> {
        self.gpu.download_f32(x)
    }

    fn to_host_rows(&self, x: &CudaSlice<f32>, rows: usize) -> Result<Vec<Vec<f32>>> {
        self.gpu.read_f32(x, |host| split_rows(host, rows))?
    }

    fn select_logits(&self, logits: &CudaSlice<f32>, vocab: usize, wants: &[LogitsWant]) -> Result<Vec<StepLogits>> {
        let _timer = self.op_timer("select_logits");
        let best = self.llm()?.select.best(logits, vocab, wants)?;
        // Rows that want the whole row (a request that keeps its logits, or samples with
        // penalties) come from one copy of all rows.
        let mut full = if best.iter().any(Option::is_none) { self.to_host_rows(logits, wants.len())? } else { Vec::new() };
        Ok(best
            .into_iter()
            .enumerate()
            .map(|(r, b)| match b {
                Some(b) => StepLogits::Best(b),
                None => StepLogits::Full(std::mem::take(&mut full[r])),
            })
            .collect())
    }

    fn residual_norm(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, w: &CudaSlice<f32>, d: usize, eps: f32, out: &mut CudaSlice<f32>) -> Result<()> {
        let _timer = self.op_timer("residual_norm");
        self.norm.residual_norm(x, y, w, d, eps, Self::out(out))
    }

    fn linear_residual_norm(
        &self,
        v: &CudaSlice<f32>,
        rows: usize,
        w: &GpuMatrix,
        x: &mut CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        d: usize,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        // One row: one GEMV launch whose last block normalises (the same bits as the two).
        if w.out == d && self.blas.norm_tail_fits(rows, w) {
            let _timer = self.op_timer("linear_residual_norm (gemv)");
            if self.blas.linear_residual_norm(v, rows, w, x, norm, eps, out)? {
                return Ok(());
            }
        }
        let y = self.linear(v, rows, w, None)?;
        self.residual_norm(x, &y, norm, d, eps, out)
    }

    fn linear_residual_norm_glu(
        &self,
        v: &CudaSlice<f32>,
        rows: usize,
        w: &GpuMatrix,
        x: &mut CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        d: usize,
        eps: f32,
        out: &mut CudaSlice<f32>,
        gate_up: &GpuMatrix,
        width: usize,
        act: GatedActivation,
    ) -> Result<CudaSlice<f32>> {
        if gate_up.out == 2 * width {
            let step = NormedStep { residual: (v, rows, w), norm, d, eps, what: "linear_residual_norm_glu (gemv)" };
            if let Some(y) = self.normed_product(step, x, out, gate_up, gated_output(act))? {
                return Ok(y);
            }
        }
        self.linear_residual_norm(v, rows, w, x, norm, d, eps, out)?;
        self.glu(out, rows, gate_up, width, act)
    }

    fn linear_residual_norm_linear(
        &self,
        (v, rows, w): (&CudaSlice<f32>, usize, &GpuMatrix),
        x: &mut CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        d: usize,
        eps: f32,
        out: &mut CudaSlice<f32>,
        next: &GpuMatrix,
    ) -> Result<CudaSlice<f32>> {
        let step = NormedStep { residual: (v, rows, w), norm, d, eps, what: "linear_residual_norm_linear (gemv)" };
        if let Some(y) = self.normed_product(step, x, out, next, GemvOutput::Plain)? {
            return Ok(y);
        }
        self.linear_residual_norm(v, rows, w, x, norm, d, eps, out)?;
        self.linear(out, rows, next, None)
    }

    fn linear_residual_norm_linears_conv(
        &self,
        (v, rows, w): (&CudaSlice<f32>, usize, &GpuMatrix),
        x: &mut CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        d: usize,
        eps: f32,
        out: &mut CudaSlice<f32>,
        ws: &[&GpuMatrix],
        conv: (&CudaSlice<f32>, usize),
        channels: usize,
        batch: &CudaBatch,
        states: &mut [&mut CudaSlice<f32>],
    ) -> Result<Vec<CudaSlice<f32>>> {
        // A decode step of one sequence: the input products' blocks form the norm
        // (Blas::linear_residual_norm_conv), their outputs allocated only where it is taken.
        let takes = w.out == d && ws.first().is_some_and(|f| f.out == channels) && self.blas.takes_normed_conv(w, ws, conv.1).is_some();
        if self.one_token(batch, rows, states) && takes {
            let _timer = self.op_timer("linear_residual_norm_linears_conv (gemv)");
            let mut ys = self.one_row_outputs(ws)?;
            let mut parts: Vec<(&GpuMatrix, &mut CudaSlice<f32>)> = ws.iter().copied().zip(ys.iter_mut()).collect();
            if self.blas.linear_residual_norm_conv(v, w, x, norm, eps, out, &mut parts, conv, &mut *states[0])? {
                return Ok(ys);
            }
        }
        self.linear_residual_norm(v, rows, w, x, norm, d, eps, out)?;
        self.linears_conv(out, rows, ws, conv, channels, batch, states)
    }

    fn silu_mul(&self, g: View<CudaSlice<f32>>, u: View<CudaSlice<f32>>, rows: usize, width: usize) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer("silu_mul");
        let mut out = self.gpu.alloc::<f32>(rows * width)?;
        self.activation.silu_mul(g, u, rows, width, Self::out(&mut out))?;
        Ok(out)
    }

    fn last_rows(&self, x: &CudaSlice<f32>, d: usize, batch: &CudaBatch) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer("last_rows");
        check_len("last_rows input", x.len(), batch.att.rows * d)?;
        let mut out = self.gpu.alloc::<f32>(batch.last_rows.len * d)?;
        self.embedding.embed_lookup(x, d, &batch.last_rows, 1.0, &mut out)?;
        Ok(out)
    }

    fn conv1d_silu(
        &self,
        x: &CudaSlice<f32>,
        channels: usize,
        w: &CudaSlice<f32>,
        kernel: usize,
        batch: &CudaBatch,
        states: &mut [&mut CudaSlice<f32>],
    ) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer("conv1d_silu");
        check_len("conv1d_silu input", x.len(), batch.att.rows * channels)?;
        let gdn = &self.llm()?.gdn;
        let mut out = self.gpu.alloc::<f32>(x.len())?;
        gdn.conv1d_silu(x, w, kernel, &batch.gdn, GpuStates::Each(states), &mut out)?;
        Ok(out)
    }

    fn gdn_gates(&self, alpha: &CudaSlice<f32>, b: &CudaSlice<f32>, dt_bias: &CudaSlice<f32>, a: &CudaSlice<f32>) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        let _timer = self.op_timer("gdn_gates");
        let (mut g, mut beta) = (self.gpu.alloc::<f32>(alpha.len())?, self.gpu.alloc::<f32>(b.len())?);
        self.llm()?.gdn.gates(alpha, b, dt_bias, a, &mut g, &mut beta)?;
        Ok((g, beta))
    }

    fn delta_rule(
        &self,
        qkv: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        heads: &DeltaRuleHeads,
        batch: &CudaBatch,
        states: &mut [&mut CudaSlice<f32>],
    ) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer("delta_rule");
        let x = delta_rule_inputs(qkv, g, beta, heads, batch.att.rows, None)?;
        let gdn = &self.llm()?.gdn;
        let mut out = self.gpu.alloc::<f32>(batch.att.rows * heads.n_v_heads * heads.d_v)?;
        // The tensor-core form takes head sizes of 64 or 128; other prefills (the tiny test
        // checkpoints' 16) take the f32 chunked form, which equals the scan to f32 rounding at
        // any length.
        let fast_fits = [heads.d_k, heads.d_v].iter().all(|d| matches!(d, 64 | 128));
        let states = GpuStates::Each(states);
        if takes_scan(heads, batch) {
            gdn.delta_rule(heads, &x, &batch.gdn, states, &mut out)?;
        } else if fast_fits && self.precision == Precision::Bf16 && !short(batch) {
            gdn.delta_rule_chunked_fast(heads, &x, &batch.gdn, states, &mut out)?;
        } else {
            gdn.delta_rule_chunked(heads, &x, &batch.gdn, states, &mut out, ChunkAccumulate::F64)?;
        }
        Ok(out)
    }

    fn gated_delta(
        &self,
        x: GatedDeltaInputs<Self>,
        heads: &DeltaRuleHeads,
        batch: &CudaBatch,
        states: &mut [&mut CudaSlice<f32>],
    ) -> Result<CudaSlice<f32>> {
        // Where the scan runs (decode steps, short runs): gates, recurrence and norm in one
        // launch (the fused recurrence, the same bits as the three ops); prefill: the three ops.
        if !takes_scan(heads, batch) || heads.d_v > FUSED_MAX_DV || x.norm.len() != heads.d_v {
            return gated_delta_in_steps(self, x, heads, batch, states);
        }
        let _timer = self.op_timer("gated_delta (fused)");
        let (rows, vd) = (batch.att.rows, heads.n_v_heads * heads.d_v);
        check_len("gated_delta z", x.z.len(), rows * vd)?;
        let fused = FusedGatesNorm { dt_bias: x.dt_bias, a: x.a, z: Rows::contiguous(x.z, vd), norm: x.norm, eps: x.eps };
        let inputs = delta_rule_inputs(x.qkv, x.alpha, x.b, heads, rows, Some(fused))?;
        let gdn = &self.llm()?.gdn;
        let mut out = self.gpu.alloc::<f32>(rows * vd)?;
        gdn.delta_rule(heads, &inputs, &batch.gdn, GpuStates::Each(states), &mut out)?;
        Ok(out)
    }

    fn gated_rms_norm(&self, y: &CudaSlice<f32>, z: &CudaSlice<f32>, w: &CudaSlice<f32>, eps: f32) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer("gated_rms_norm");
        let mut out = self.gpu.alloc::<f32>(y.len())?;
        self.llm()?.gdn.gated_rms_norm(y, z, w, eps, &mut out)?;
        Ok(out)
    }

    fn kv_attention(
        &self,
        q: View<CudaSlice<f32>>,
        k: View<CudaSlice<f32>>,
        v: View<CudaSlice<f32>>,
        gate: View<CudaSlice<f32>>,
        batch: &CudaBatch,
        caches: &mut [&mut GpuKv],
        shape: &AttentionShape,
    ) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer("kv_attention");
        let mut out = self.gpu.alloc::<f32>(batch.att.rows * shape.q_heads * shape.hd)?;
        let kv = &self.llm()?.kv;
        // A prompt from empty caches (the prefill) runs on the tiled flash kernels; decode and
        // continued prompts attend over the cache.
        let views_fit = [&q, &k, &v].iter().all(|x| x.offset % 4 == 0 && x.stride % 4 == 0) && shape.hd % 4 == 0;
        if batch.past.iter().all(|&p| p == 0) && views_fit && batch.att.rows > batch.past.len() {
            kv.prefill(&self.attention, q, k, v, gate, &batch.att, &batch.positions, caches, shape, &mut out, self.precision == Precision::Bf16)?;
        } else {
            kv.kv_attention(q, k, v, gate, &batch.att.segments, &batch.past, &batch.positions, caches, shape, &mut out, None)?;
        }
        Ok(out)
    }

    fn projected_kv_attention(
        &self,
        y: &mut CudaSlice<f32>,
        heads: ProjectedHeads<Self>,
        batch: &CudaBatch,
        caches: &mut [&mut GpuKv],
        shape: &AttentionShape,
    ) -> Result<CudaSlice<f32>> {
        // A decode step (each sequence one new row) prepares its heads in the attention.
        let decode = !batch.att.segments.is_empty() && batch.att.segments.iter().all(|s| s.len == 1);
        if !(self.kv_prep && decode) {
            return projected_kv_attention_composed(self, y, heads, batch, caches, shape);
        }
        let _timer = self.op_timer("kv_attention (heads prepared)");
        let ProjectedHeads { stride, q, gate, k, v, q_prep, k_prep } = heads;
        let prep = KvHeadPrep { q: gpu_head_prep(&q_prep), k: gpu_head_prep(&k_prep), max_position: batch.max_position };
        let mut out = self.gpu.alloc::<f32>(batch.att.rows * shape.q_heads * shape.hd)?;
        let view = |offset| View::new(&*y, offset, stride);
        let kv = &self.llm()?.kv;
        kv.kv_attention(view(q), view(k), view(v), view(gate), &batch.att.segments, &batch.past, &batch.positions, caches, shape, &mut out, Some(&prep))?;
        Ok(out)
    }

    fn moe(&self, x: &CudaSlice<f32>, d: usize, router_logits: &CudaSlice<f32>, experts: &GpuExperts, top_k: usize) -> Result<CudaSlice<f32>> {
        let _timer = self.op_timer("moe");
        if d == 0 || x.len() % d != 0 || experts.hidden != d {
            return Err(Error::Shape(format!("moe: {} elements as rows of {d} for experts of width {}", x.len(), experts.hidden)));
        }
        let rows = x.len() / d;
        let ne = experts.experts.len();
        let stride = experts.router_stride();
        check_len("moe router logits", router_logits.len(), rows * stride)?;
        // A few rows (decode) route on the device: nothing is read back, so the step records.
        // The shared expert, where it shares the tables, is each row's last slot.
        if let Some(RoutedSlots { down, ids, weights, act, per_row }) = self.routed_slots(x, rows, router_logits, experts, top_k)? {
            let moe = &self.llm()?.moe;
            let slots = rows * per_row;
            let mut y = self.gpu.alloc::<f32>(slots * d)?;
            self.blas.routed(down, &ids, slots, &act, 1, GemvOutput::Plain, &mut y)?;
            let mut out = self.gpu.alloc::<f32>(rows * d)?;
            moe.combine(&y, None, &weights, per_row, d, &mut out)?;
            if !experts.shared_routed {
                self.add_shared_expert(x, rows, router_logits, experts, &mut out)?;
            }
            return Ok(out);
        }
        // Many rows (a prompt): each (row, choice) slot's input gathered into rows sorted by
        // expert, so that each expert's products run once over all its rows (cuBLAS on the
        // expert's slice of the sorted rows), then one combine reads each slot's output back
        // by its sorted position. Routing: [rows][k] ids in ascending expert order and their
        // weights, on the device where it can (only the ids come back), else on the host.
        let slots = rows * top_k;
        let tile_rows = |gate_up: &GpuMatrixTable| {
            let tc = self.blas.tiles_on_tensor_cores(gate_up);
            self.moe_tile_rows.unwrap_or(if tc { MOE_TILE_ROWS_TENSOR_CORES } else { MOE_TILE_ROWS })
        };
        let device_routing = top_k <= MAX_DEVICE_TOP_K && top_k <= ne && ne <= MAX_DEVICE_EXPERTS;
        let routed_on_device = if device_routing {
            let (mut ids, mut weights) = (self.gpu.alloc::<i32>(slots)?, self.gpu.alloc::<f32>(slots)?);
            self.llm()?.moe.route(router_logits, ne, stride, top_k, false, &mut ids, &mut weights)?;
            Some((ids, weights))
        } else {
            None
        };
        // Sorted on the device (steps of few rows by default): where the tiles serve even with
        // every expert used (the host's test counts the experts used, which the host does not
        // learn here).
        let sort_on_device = |gu: &GpuMatrixTable| {
            self.moe_device_sort.unwrap_or(rows <= MOE_DEVICE_SORT_MAX_ROWS) && rows > 0 && ne <= MAX_SORT_EXPERTS && slots <= tile_rows(gu) * ne.min(slots) && SortedSlots::max_tiles(slots, ne) <= 65_535
        };
        if let (Some((ids, weights)), Some((gate_up, down))) = (&routed_on_device, experts.routed.as_ref().filter(|(gu, _)| sort_on_device(gu))) {
            let moe = &self.llm()?.moe;
            let sorted = moe.sort_slots(ids, top_k, ne)?;
            let mut gathered = self.gpu.alloc::<f32>(slots * d)?;
            // Every token is an input row: sort_slots writes s / k for slot s of rows × k.
            let token = GpuIds { ids: sorted.token, len: slots, max: (rows - 1) as u32 };
            self.embedding.embed_lookup(x, d, &token, 1.0, &mut gathered)?;
            let mut act = self.gpu.alloc::<f32>(slots * experts.width)?;
            self.blas.tiles_counted(gate_up, &sorted.tiles, &sorted.n_tiles, sorted.max_tiles, &gathered, GemvOutput::Silu, &mut act)?;
            drop(gathered);
            let mut y = self.gpu.alloc::<f32>(slots * d)?;
            self.blas.tiles_counted(down, &sorted.tiles, &sorted.n_tiles, sorted.max_tiles, &act, GemvOutput::Plain, &mut y)?;
            let mut out = self.gpu.alloc::<f32>(rows * d)?;
            moe.combine_sorted(&y, &sorted.pos, weights, top_k, d, &mut out)?;
            self.add_shared_expert(x, rows, router_logits, experts, &mut out)?;
            return Ok(out);
        }
        let (ids, weights) = if let Some((ids, weights)) = routed_on_device {
            let ids = self.gpu.download(&ids)?.into_iter().map(|e| usize::try_from(e).ok().filter(|&e| e < ne));
            (ids.collect::<Option<Vec<usize>>>().ok_or_else(|| Error::Cuda("moe routing on the device chose an expert outside the table".into()))?, weights)
        } else {
            let logits: Vec<f32> = self.to_host(router_logits)?.chunks(stride).flat_map(|r| r[..ne].iter().copied()).collect();
            let routed = crate::kernels::moe::route(&logits, ne, top_k)?;
            let (mut ids, mut weights, mut taken) = (vec![0usize; slots], vec![0.0f32; slots], vec![0usize; rows]);
            for (e, tokens) in routed.iter().enumerate() {
                for &(t, w) in tokens {
                    let j = &mut taken[t];
                    (ids[t * top_k + *j], weights[t * top_k + *j]) = (e, w);
                    *j += 1;
                }
            }
            (ids, self.gpu.upload(&weights)?)
        };
        let SlotOrder { start, token, pos } = sort_slots_on_host(&ids, top_k, ne);
        let mut gathered = self.gpu.alloc::<f32>(slots * d)?;
        self.embedding.embed_lookup(x, d, &GpuIds::new(&self.gpu, &token)?, 1.0, &mut gathered)?;
        let w = experts.width;
        let mut y = self.gpu.alloc::<f32>(slots * d)?;
        let used = start.windows(2).filter(|r| r[1] > r[0]).count();
        match &experts.routed {
            // Few rows an expert: GEMVs over tiles of each expert's rows, which read the
            // stored weights as they are, in one launch a product.
            Some((gate_up, down)) if slots <= tile_rows(gate_up) * used => {
                let tiles = expert_tiles(&start)?;
                let mut act = self.gpu.alloc::<f32>(slots * w)?;
                self.blas.tiles(gate_up, &tiles, &gathered, GemvOutput::Silu, &mut act)?;
                drop(gathered);
                self.blas.tiles(down, &tiles, &act, GemvOutput::Plain, &mut y)?;
            }
            // Many rows an expert: one GEMM per expert over its rows (tensor cores in fast mode).
            _ => {
                let groups = |m: fn(&(GpuMatrix, GpuMatrix)) -> &GpuMatrix| -> Vec<(&GpuMatrix, usize, usize)> {
                    experts.experts.iter().enumerate().map(|(e, pair)| (m(pair), start[e], start[e + 1] - start[e])).collect()
                };
                let mut gu = self.gpu.alloc::<f32>(slots * 2 * w)?;
                self.blas.grouped_linear(&gathered, &groups(|p| &p.0), &mut gu)?;
                drop(gathered);
                let act = self.silu_mul(View::new(&gu, 0, 2 * w), View::new(&gu, w, 2 * w), slots, w)?;
                drop(gu);
                self.blas.grouped_linear(&act, &groups(|p| &p.1), &mut y)?;
            }
        }
        let mut out = self.gpu.alloc::<f32>(rows * d)?;
        let moe = &self.llm()?.moe;
        moe.combine(&y, Some(&pos), &weights, top_k, d, &mut out)?;
        self.add_shared_expert(x, rows, router_logits, experts, &mut out)?;
        Ok(out)
    }

    fn moe_residual_norm(
        &self,
        a: &mut CudaSlice<f32>,
        d: usize,
        router_logits: &CudaSlice<f32>,
        experts: &GpuExperts,
        top_k: usize,
        x: &mut CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<()> {
        // A decode step of one sequence whose shared expert (if any) is a routed slot: the down
        // products, their sum, the residual step and the norm in one launch. (With 8 rows the
        // fused sum, then a norm launch, measured slower than the routed GEMV's 8 × 9 slots of
        // blocks and the combine: 3 539 against 3 855 tok/s, Qwen3.5-35B-A3B's first 8 layers,
        // BF16, H200.)
        let fused = experts.hidden == d && x.len() == d && a.len() == d && (experts.shared.is_none() || experts.shared_routed);
        if fused && self.moe_fused_residual {
            let _timer = self.op_timer("moe_residual_norm");
            check_len("moe router logits", router_logits.len(), experts.router_stride())?;
            if let Some(RoutedSlots { down, ids, weights, act, per_row }) = self.routed_slots(a, 1, router_logits, experts, top_k)? {
                return self.blas.routed_residual_norm(down, &ids, &weights, per_row, &act, x, norm, eps, a);
            }
        }
        let y = self.moe(a, d, router_logits, experts, top_k)?;
        self.residual_norm(x, &y, norm, d, eps, a)
    }

}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precisions_parse_and_fp16_is_refused_with_the_reason() {
        assert_eq!("f32".parse::<Precision>().unwrap(), Precision::F32);
        assert_eq!("bf16".parse::<Precision>().unwrap(), Precision::Bf16);
        for half in ["fp16", "f16", "float16", "half"] {
            match half.parse::<Precision>() {
                Err(Error::Input(m)) => assert!(m.contains("overflow"), "{m}"),
                other => panic!("{half}: expected a refusal, got {other:?}"),
            }
        }
        assert!("int8".parse::<Precision>().is_err());
    }
}
