//! CUDA forms of the gated-delta family: the sources (`*.cu` beside this file, each compiled
//! by NVRTC with `common.cuh` in front) and their launchers. Every launcher validates shapes
//! on the host before it launches, with the same checks and messages as the CPU twins in the
//! parent module, which are the reference every kernel is tested against.
//!
//! Device-side batches: a [`GpuSegments`] is the packed batch's segments plus, per sequence,
//! the slot of its state in a state pool (`[n_slots][state_len]` in one buffer), so one launch
//! advances any subset of a pool of sequences. Decode is the one-token-segment case of the same
//! launch, as on the CPU.
//!
//! q, k and v are passed as [`Rows`] (a buffer, an offset and a row stride), so the recurrence
//! can read them straight out of the conv output `[tokens][q | k | v]` and, with
//! `normalize_qk`, L2-normalise q and k in registers: neither a split copy nor a normalised
//! copy goes through device memory.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYN_SMEM;
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};

use crate::cuda::{driver_err, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig, StateRanges};
use crate::error::{Error, Result};
use crate::kernels::gated_delta::{check_segments, DeltaRuleHeads, KeyHeadMap, L2_NORM_EPS};
use crate::kernels::{check_len, Segment};

macro_rules! gdn_source {
    ($name:literal, $($file:literal),+) => {
        KernelSource { name: $name, code: concat!(include_str!("common.cuh") $(, "\n", include_str!($file))+) }
    };
}

pub const GATES: KernelSource = gdn_source!("tern_gdn_gates", "gates.cu");
pub const CONV: KernelSource = gdn_source!("tern_gdn_conv", "conv_sum.cuh", "conv.cu");
pub const NORM: KernelSource = gdn_source!("tern_gdn_norm", "norm.cu");
pub const RECURRENCE: KernelSource = gdn_source!("tern_gdn_recurrence", "recurrence.cu");
pub const CHUNKED: KernelSource = gdn_source!("tern_gdn_chunked", "chunked.cu");
pub const CHUNKED_TC: KernelSource = gdn_source!("tern_gdn_chunked_tc", "../../wgmma.cuh", "chunked_tc.cu");

/// The warpgroup products (src/kernels/wgmma.cuh) checked against the CPU on their own
/// (tests.rs, `cuda_wgmma_products_match_cpu`): only that test loads it.
pub const WGMMA_CHECK: KernelSource = gdn_source!("tern_gdn_wgmma_check", "../../wgmma.cuh", "wgmma_check.cu");

/// The family's CUDA translation units.
pub const SOURCES: &[KernelSource] = &[GATES, CONV, NORM, RECURRENCE, CHUNKED, CHUNKED_TC, WGMMA_CHECK];

/// Threads per block of the one-thread-per-element kernels.
const ELEMENT_BLOCK: u32 = 256;
/// Warps per block of the one-warp-per-row kernels: 4 rows of a head share its k and q in L1.
const ROW_WARPS: u32 = 4;
/// How the recurrence spreads state rows over warps: `(rows, groups)` means a warp advances
/// `rows` rows of a head together, for `groups` consecutive row groups (the next group's state
/// requested before the current group's tokens). The default: eight rows per warp keep the most
/// state bytes in flight (H200, 35B-A3B shapes: 87% of the copy bandwidth at 64 sequences and
/// 93% at 256, against 79% and 84% for four rows).
pub const RECURRENCE_VARIANT: (usize, usize) = (8, 1);
/// The default for a decode step of at least [`MANY_DECODE_SEQS`] sequences: two row groups a
/// warp, the second group's state in flight while the first is advanced (H200, 4 warps a block,
/// 256 sequences: 275 µs against 284 µs for (8, 1); at 16 and 64 sequences (8, 1) is 6% and 3%
/// faster).
pub const RECURRENCE_VARIANT_MANY: (usize, usize) = (8, 2);
pub const MANY_DECODE_SEQS: usize = 128;
/// The variants compiled: the arithmetic of each row is the same in all of them, so they agree
/// bit for bit (a device test checks it); only the speed differs.
pub const RECURRENCE_VARIANTS: [(usize, usize); 9] = [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2), (2, 4), (4, 4)];
/// Warps per block of the (unfused) recurrence: a block only groups warps for the scheduler
/// (they share nothing), and a block's slot is freed only when its slowest warp ends.
pub const RECURRENCE_BLOCK_WARPS: u32 = 4;
/// The block sizes the launcher accepts ([`GatedDeltaCuda::set_recurrence_block_warps`]), up
/// to the kernels' `__launch_bounds__(128)`.
pub const RECURRENCE_BLOCK_WARP_CHOICES: [u32; 3] = [1, 2, 4];

fn grid_1d(n: usize, block: u32) -> Result<u32> {
    u32::try_from(n.div_ceil(block as usize)).map_err(|_| Error::Shape(format!("{n} elements: too many for one launch")))
}

fn u32_of(what: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::Shape(format!("{what}: {n} does not fit the device's 32-bit index")))
}

fn i32_of(what: &str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::Shape(format!("{what}: {n} does not fit the device's 32-bit index")))
}

fn launch_err(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Error + '_ {
    driver_err(what)
}

/// A packed batch on the device: sequence `s` owns token rows `segments[s]` and state slot
/// `slots[s]`.
pub struct GpuSegments {
    segments: Vec<Segment>,
    slots: Vec<usize>,
    tokens: usize,
    start: CudaSlice<u32>,
    len: CudaSlice<u32>,
    slot: CudaSlice<u32>,
    /// What the recurrence may compute instead of loading from the tables above
    /// ([`DIRECT_SLOTS`], [`DIRECT_DECODE`]), and the first slot.
    direct: i32,
    first_slot: u32,
    /// The chunked forms' table, made at their first use and kept with the batch, so that a
    /// recorded step (which may not copy from the host) finds it already on the device.
    chunks: std::sync::OnceLock<Option<ChunkTable>>,
}

/// The batch's slots are consecutive (sequence s in slot first + s), as when its states are one
/// tensor of sequences: the recurrence computes a state's address instead of loading its slot.
const DIRECT_SLOTS: i32 = 1;
/// Every sequence is one token, row s of sequence s (a decode step): the recurrence takes the
/// token's rows without loading its segment. With both, a decode step's first loads (state, k,
/// q, v, gates) depend on nothing loaded; through the tables they wait for an L2 round trip
/// first. Measured on an H100 (35B-A3B shapes, graph replays): 4.045 -> 3.984 µs a step of one
/// sequence, 0.2-0.4% at 16-256.
const DIRECT_DECODE: i32 = 2;
/// No kernel that may still run when this launch starts writes a state it reads (`Gpu::state_reads_may_lead`:
/// a dependent launch, whose blocks start while the kernel before it runs): each warp requests
/// its first state rows before it awaits that kernel, as the one-row GEMVs request their weights. In a decode step
/// the recurrence follows the layer's input products and conv, so a layer's state streams in
/// while they end. The same bits.
const EARLY_STATE: i32 = 4;

impl GpuSegments {
    /// Validates that the segments lie inside `tokens` rows without overlapping and that no
    /// two sequences share a slot (both would be races on the device, not just wrong answers).
    pub fn new(gpu: &Gpu, segments: &[Segment], slots: &[usize], tokens: usize) -> Result<Self> {
        check_segments("device segments", segments, tokens)?;
        if slots.len() != segments.len() {
            return Err(Error::Shape(format!("device segments: {} slots for {} sequences", slots.len(), segments.len())));
        }
        let mut sorted = slots.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::Shape(format!("device segments: state slot {} given to two sequences", w[0])));
        }
        if segments.len() > 65_535 {
            return Err(Error::Shape(format!("device segments: {} sequences, at most 65535 per launch", segments.len())));
        }
        u32_of("tokens", tokens)?;
        let start: Vec<u32> = segments.iter().map(|s| s.start as u32).collect();
        let len: Vec<u32> = segments.iter().map(|s| s.len as u32).collect();
        let slot: Vec<u32> = slots.iter().map(|&s| u32_of("state slot", s)).collect::<Result<_>>()?;
        let consecutive = slot.iter().enumerate().all(|(i, &s)| s as usize == slot[0] as usize + i);
        let decode = segments.iter().enumerate().all(|(i, s)| s.start == i && s.len == 1);
        let direct = if consecutive { DIRECT_SLOTS } else { 0 } | if decode { DIRECT_DECODE } else { 0 };
        Ok(GpuSegments {
            direct,
            first_slot: slot.first().copied().unwrap_or(0),
            segments: segments.to_vec(),
            slots: slots.to_vec(),
            tokens,
            start: gpu.upload(&start)?,
            len: gpu.upload(&len)?,
            slot: gpu.upload(&slot)?,
            chunks: std::sync::OnceLock::new(),
        })
    }

    /// One decode token per sequence: row `s` belongs to sequence `s`, in state slot `slots[s]`.
    pub fn decode(gpu: &Gpu, slots: &[usize]) -> Result<Self> {
        let segments = crate::kernels::pack(std::iter::repeat_n(1, slots.len()));
        Self::new(gpu, &segments, slots, slots.len())
    }

    pub fn n_seqs(&self) -> usize {
        self.segments.len()
    }
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The batch's chunk table (None without tokens), uploaded at the first call.
    fn chunk_table(&self, gpu: &Gpu) -> Result<Option<&ChunkTable>> {
        if let Some(t) = self.chunks.get() {
            return Ok(t.as_ref());
        }
        let t = ChunkTable::new(gpu, self)?;
        Ok(self.chunks.get_or_init(|| t).as_ref())
    }

    /// Checks that a pool of `pool_len` elements holds every slot used, at `per_slot` each.
    fn check_pool(&self, what: &str, pool_len: usize, per_slot: usize) -> Result<()> {
        if per_slot == 0 || pool_len % per_slot != 0 {
            return Err(Error::Shape(format!("{what}: a pool of {pool_len} elements is not slots of {per_slot}")));
        }
        let n_slots = pool_len / per_slot;
        if let Some(&bad) = self.slots.iter().find(|&&s| s >= n_slots) {
            return Err(Error::Shape(format!("{what}: state slot {bad} of a pool of {n_slots}")));
        }
        Ok(())
    }
}

/// Rows of f32 (or, for the fast prefill's bf16 form, bf16 as `u16` bits) in a device buffer:
/// row `t` is `row_len` elements at `offset + t·stride`.
pub struct Rows<'a, T = f32> {
    pub buf: &'a CudaSlice<T>,
    pub offset: usize,
    pub stride: usize,
}

impl<T> Clone for Rows<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Rows<'_, T> {}

impl<'a, T> Rows<'a, T> {
    pub fn contiguous(buf: &'a CudaSlice<T>, row_len: usize) -> Self {
        Rows { buf, offset: 0, stride: row_len }
    }

    /// The device address of row 0.
    fn address(&self, gpu: &Gpu) -> u64 {
        gpu.ptr(self.buf) + (std::mem::size_of::<T>() * self.offset) as u64
    }

    fn check(&self, what: &str, rows: usize, row_len: usize) -> Result<()> {
        if self.stride < row_len && rows > 1 {
            return Err(Error::Shape(format!("{what}: row stride {} is shorter than a row of {row_len}", self.stride)));
        }
        // 16-byte loads: rows must start on 16-byte boundaries (cudaMalloc aligns the base).
        let per = 16 / std::mem::size_of::<T>();
        if self.offset % per != 0 || self.stride % per != 0 {
            return Err(Error::Shape(format!(
                "{what}: offset {} and row stride {} must be multiples of {per} elements (16 bytes)",
                self.offset, self.stride
            )));
        }
        let need = if rows == 0 { 0 } else { self.offset + (rows - 1) * self.stride + row_len };
        if need > self.buf.len() {
            return Err(Error::Shape(format!("{what}: {rows} rows need {need} elements, the buffer has {}", self.buf.len())));
        }
        Ok(())
    }
}

/// Per-token operands of the delta rule on the device (layouts of the parent module; q and k
/// rows hold `n_k_heads · d_k`, v rows `n_v_heads · d_v`; g and β are `[tokens][n_v_heads]`).
#[derive(Clone, Copy)]
pub struct GpuDeltaRuleInputs<'a> {
    pub q: Rows<'a>,
    pub k: Rows<'a>,
    pub v: Rows<'a>,
    pub g: &'a CudaSlice<f32>,
    pub beta: &'a CudaSlice<f32>,
    /// q and k are raw: L2-normalise both (eps [`L2_NORM_EPS`]) and scale q by `1/√d_k` in the
    /// kernel, as [`crate::kernels::gated_delta::normalize_qk`] would beforehand.
    pub normalize_qk: bool,
    /// The recurrence only ([`GatedDeltaCuda::delta_rule`]): `g` and `beta` hold the raw
    /// projections alpha and b, the gates are formed inside the kernel and its output goes
    /// through the gated RMS norm, one launch for what [`GatedDeltaCuda::gates`], the
    /// recurrence and [`GatedDeltaCuda::gated_rms_norm`] do, with the same bits.
    pub fused: Option<FusedGatesNorm<'a>>,
}

/// The fast prefill's operands in bf16 ([`GatedDeltaCuda::delta_rule_chunked_fast_bf16`]): q,
/// k, v rows as bf16 bits (the layouts of [`GpuDeltaRuleInputs`]), the gates in f32.
#[derive(Clone, Copy)]
pub struct GpuBf16DeltaRuleInputs<'a> {
    pub q: Rows<'a, u16>,
    pub k: Rows<'a, u16>,
    pub v: Rows<'a, u16>,
    pub g: &'a CudaSlice<f32>,
    pub beta: &'a CudaSlice<f32>,
    /// As [`GpuDeltaRuleInputs::normalize_qk`].
    pub normalize_qk: bool,
}

/// Device addresses of the fast prefill's operands, either element type (FastIo): q, k, v as
/// (row 0, stride in elements).
struct FastOperands {
    q: (u64, i64),
    k: (u64, i64),
    v: (u64, i64),
    g: u64,
    beta: u64,
    normalize_qk: bool,
    out: u64,
}

impl FastOperands {
    fn new<T>(gpu: &Gpu, [q, k, v]: [&Rows<T>; 3], [g, beta]: [&CudaSlice<f32>; 2], normalize_qk: bool, out: u64) -> Self {
        let rows = |r: &Rows<T>| (r.address(gpu), r.stride as i64);
        FastOperands { q: rows(q), k: rows(k), v: rows(v), g: gpu.ptr(g), beta: gpu.ptr(beta), normalize_qk, out }
    }
}

/// The element type of the fast prefill's q, k, v and output: f32, or bf16 as fla takes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FastIo {
    F32,
    Bf16,
}

/// What the fused recurrence needs beyond the plain one: the gates' `dt_bias` and `a`
/// ([n_v_heads]), the output gate `z` ([tokens][n_v_heads·d_v] rows) and the norm's weight
/// ([d_v]) and epsilon.
#[derive(Clone, Copy)]
pub struct FusedGatesNorm<'a> {
    pub dt_bias: &'a CudaSlice<f32>,
    pub a: &'a CudaSlice<f32>,
    pub z: Rows<'a>,
    pub norm: &'a CudaSlice<f32>,
    pub eps: f32,
}

/// Where each sequence of a batch keeps its state: a slot of one pool (the batch's slots), or
/// a buffer of its own, which the kernels find through a device table of addresses
/// ([`Gpu::address_table`]), so a batch of sequences needs no copies into a pool and back.
pub enum GpuStates<'a, 'b> {
    Pool(&'a mut CudaSlice<f32>),
    Each(&'a mut [&'b mut CudaSlice<f32>]),
}

impl GpuStates<'_, '_> {
    /// Checks the states against the batch (`per` elements a sequence) and returns the pool's
    /// address (0 with a table), the address table (with `Each`), and the device bytes the
    /// states span (the whole pool; each sequence's state), for [`Gpu::state_reads_may_lead`].
    fn resolve(&mut self, gpu: &Gpu, what: &str, segs: &GpuSegments, per: usize) -> Result<(u64, Option<Arc<CudaSlice<u64>>>, StateRanges)> {
        let span = |at: u64, len: usize| (at, at + 4 * len as u64);
        match self {
            GpuStates::Pool(pool) => {
                segs.check_pool(what, pool.len(), per)?;
                let at = gpu.ptr(&**pool);
                Ok((at, None, vec![span(at, pool.len())]))
            }
            GpuStates::Each(states) => {
                if states.len() != segs.n_seqs() {
                    return Err(Error::Shape(format!("{what}: {} states for {} sequences", states.len(), segs.n_seqs())));
                }
                if let Some(s) = states.iter().find(|s| s.len() != per) {
                    return Err(Error::Shape(format!("{what}: a state of {} elements where {per} are expected", s.len())));
                }
                let addresses: Vec<u64> = states.iter().map(|s| gpu.ptr(&**s)).collect();
                let ranges = addresses.iter().map(|&at| span(at, per)).collect();
                Ok((0, Some(gpu.address_table(&addresses)?), ranges))
            }
        }
    }
}

/// The checks of a launcher's per-token operands, either element type: the heads, q, k, v rows
/// over `tokens`, the gates g and β, and an output of `out_len` elements.
fn check_operands<T>(what: &str, heads: &DeltaRuleHeads, [q, k, v]: [&Rows<T>; 3], [g, beta]: [&CudaSlice<f32>; 2], out_len: usize, tokens: usize) -> Result<()> {
    heads.validate()?;
    let t = tokens;
    q.check(&format!("{what} q"), t, heads.n_k_heads * heads.d_k)?;
    k.check(&format!("{what} k"), t, heads.n_k_heads * heads.d_k)?;
    v.check(&format!("{what} v"), t, heads.n_v_heads * heads.d_v)?;
    check_len(&format!("{what} g"), g.len(), t * heads.n_v_heads)?;
    check_len(&format!("{what} beta"), beta.len(), t * heads.n_v_heads)?;
    check_len(&format!("{what} output"), out_len, t * heads.n_v_heads * heads.d_v)
}

/// Mirrors `tern_gdn_recurrence_args` in recurrence.cu field for field (C layout).
#[repr(C)]
#[derive(Clone, Copy)]
struct RecurrenceArgs {
    states: u64,
    slot: u64,
    state_at: u64,
    q: u64,
    q_stride: i64,
    k: u64,
    k_stride: i64,
    v: u64,
    v_stride: i64,
    g: u64,
    beta: u64,
    out: u64,
    seg_start: u64,
    seg_len: u64,
    dt_bias: u64,
    a: u64,
    z: u64,
    z_stride: i64,
    norm_w: u64,
    norm_eps: f32,
    nk: i32,
    nv: i32,
    dv: i32,
    grouped: i32,
    l2qk: i32,
    eps: f32,
    q_scale: f32,
    slot_base: u32,
    direct: i32,
}
// SAFETY: plain data, laid out as the kernel's struct.
unsafe impl DeviceRepr for RecurrenceArgs {}

/// The fused recurrence takes value heads of at most this many rows (TERN_GDN_FUSED_MAX_DV in
/// recurrence.cu), 8 a warp, one block a head.
pub const FUSED_MAX_DV: usize = 128;
const FUSED_ROWS_PER_WARP: usize = 8;

/// The family's kernels, loaded for one GPU.
pub struct GatedDeltaCuda {
    gpu: Arc<Gpu>,
    gates: CudaFunction,
    conv: Vec<CudaFunction>, // kernel widths 1..=8
    normalize_qk: CudaFunction,
    gated_norm: CudaFunction,
    /// Every compiled form of the recurrence (recurrence.cu's kernels), by its key.
    recurrence: Vec<(RecurrenceKernel, CudaFunction)>,
    /// Whether the fused form runs bounded to two blocks a multiprocessor where d_k <= 128
    /// (`_b64`, `_s_b64` in recurrence.cu): the default, TERN_GDN_FUSED_BOUND=0 turns it off.
    /// Timed on an H100 (2026-12-05, gdn_bench, 35B-A3B shapes, scatter sums, µs a step):
    /// 7.28 -> 7.20 at 1 sequence, 33.2 -> 30.3 at 16, 119.8 -> 101.4 at 64, 530 -> 382 at 256;
    /// Qwen3.5-0.8B's decode rounds of 128 sequences 21 051 -> 21 804 tok/s.
    fused_bound64: bool,
    /// Whether the recurrence computes what a batch lets it (`GpuSegments::direct`) rather than
    /// loading it from the tables: the same bits. On by default; TERN_GDN_DIRECT=0 turns it off.
    direct_addressing: bool,
    /// EARLY_STATE on every launch (`Some(true)`: the device tests, [`Self::set_early_state`]),
    /// never (`Some(false)`: TERN_GDN_EARLY_STATE=0, to measure the two on the same run), or
    /// where `Gpu::state_reads_may_lead` allows (`None`, the default). The same bits.
    early_state: Option<bool>,
    /// Whether the forms that have them take the scatter sums (the same bits with fewer
    /// shuffles; the default, TERN_GDN_SCATTER=0 turns them off), and the (8, 1) form its
    /// 64-register kernel (TERN_GDN_SCATTER=64). Timed on an H100 (2026-12-05, graph replays,
    /// 35B-A3B shapes): 4.38 -> 3.97 µs at 1 sequence, 26.24 -> 25.64 at 16, 96.9 -> 96.1 at
    /// 64, 371.2 -> 371.1 at 256; the fused form 7.58 -> 7.34 at 1, 35.1 -> 34.0 at 16.
    scatter: ScatterSums,
    /// None: [`RECURRENCE_VARIANT`], or [`RECURRENCE_VARIANT_MANY`] for a large decode step.
    recurrence_variant: Option<(usize, usize)>,
    recurrence_block_warps: u32,
    /// Chunk-prepare and chunk-state kernels with f32 and f64 accumulators.
    chunk_prepare: [CudaFunction; 2],
    /// Indexed [accumulator][8 or 16 rows].
    chunk_state: [[CudaFunction; 2]; 2],
    chunk_state_rows: usize,
    /// Benchmark aid: stop the chunked prefill after its parallel pass (the result is then
    /// incomplete), so that the two passes can be timed apart.
    chunk_prepare_only: bool,
    /// Fast mode: prepare kernels by (d_k, d_v, rows, compact, tiled) and state kernels by
    /// (d_k, stages, late issue, in clusters, warpgroup, transposed, state rows); those in clusters
    /// only where the device has them, the warpgroup ones only on sm_90.
    tc_prepare: Vec<((usize, usize, usize, bool, bool), CudaFunction)>,
    tc_state: Vec<((usize, usize, bool, bool, bool, bool, usize), CudaFunction)>,
    /// Segments a sequence's chunks are cut into for the state pass (None: as many as fill the
    /// device, [`FastVariant::segments`]); tests and benchmarks fix it (TERN_GDN_STATE_SEGMENTS).
    state_segments: Option<usize>,
    fast_variant: FastVariant,
    /// Blocks a cluster of the state pass in clusters share a chunk's tiles among: 2, or 4
    /// where d_v is 128 (TERN_GDN_CLUSTER_BLOCKS). 2 by default: with one block a
    /// multiprocessor an H100 holds at most 30 clusters of 4 at once, fewer than the 32 value
    /// heads of Qwen3.5-35B-A3B (ncu, BENCHMARKS.md, twenty-seventh session).
    /// 1 launches the cluster kernel without clusters: each block fetches its own chunks with
    /// six bulk copies (no multicast), issued where LATE issues cp.async (0.96 against the
    /// default's 0.88 ms at 32k tokens on an H100, BENCHMARKS.md, twenty-eighth session).
    cluster_blocks: usize,
    /// The default variant's kernels with bf16 q, k, v in (prepare, by (d_k, d_v)) and a bf16
    /// output (state, by d_k, warpgroup form and state rows): [`GatedDeltaCuda::delta_rule_chunked_fast_bf16`].
    tc_prepare_bf16: Vec<((usize, usize), CudaFunction)>,
    tc_state_bf16: Vec<((usize, bool, usize), CudaFunction)>,
    /// Per-(chunk, head) intermediates of the chunked prefill (either mode), grown on demand.
    /// Shared with the graphs of the steps that used it: a recorded prefill holds its address,
    /// so growing it (for a longer prompt) must not free it under such a graph.
    chunk_scratch: Mutex<Option<Arc<CudaSlice<f32>>>>,
}

/// The forms of the recurrence: rows and row groups a warp, or the fused decode step (gates,
/// recurrence and gated norm; 8 rows a warp, one block a head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RecurrenceForm {
    Rows(usize, usize),
    Fused,
}

/// One kernel of recurrence.cu: its d_k, form, whether it sums a warp's rows by scatter, and
/// whether it is held to 64 registers (the (8, 1) form: 8 blocks a multiprocessor; the fused
/// one: 2). Every form computes the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RecurrenceKernel {
    d_k: usize,
    form: RecurrenceForm,
    scatter: bool,
    bound64: bool,
}

impl RecurrenceKernel {
    /// Every kernel recurrence.cu instantiates.
    fn all() -> Vec<RecurrenceKernel> {
        let mut all = Vec::new();
        for d_k in [32usize, 64, 128, 256] {
            let k = |form, scatter, bound64| RecurrenceKernel { d_k, form, scatter, bound64 };
            all.extend(RECURRENCE_VARIANTS.map(|(r, g)| k(RecurrenceForm::Rows(r, g), false, false)));
            all.push(k(RecurrenceForm::Fused, false, false));
            all.extend([k(RecurrenceForm::Rows(8, 1), true, false), k(RecurrenceForm::Rows(8, 2), true, false), k(RecurrenceForm::Fused, true, false)]);
            if d_k <= 128 {
                all.extend([k(RecurrenceForm::Rows(8, 1), true, true), k(RecurrenceForm::Fused, false, true), k(RecurrenceForm::Fused, true, true)]);
            }
        }
        all
    }

    fn name(&self) -> String {
        let sums = if self.scatter { "_s" } else { "" };
        match self.form {
            RecurrenceForm::Rows(r, g) => format!("tern_gdn_recurrence_dk{}_r{r}_g{g}{sums}{}", self.d_k, if self.bound64 { "64" } else { "" }),
            RecurrenceForm::Fused => format!("tern_gdn_recurrence_fused_dk{}{sums}{}", self.d_k, if self.bound64 { "_b64" } else { "" }),
        }
    }
}

/// How the recurrence sums a warp's rows ([`GatedDeltaCuda::set_scatter_sums`]); the same bits
/// in every form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScatterSums {
    /// One butterfly a row.
    Off,
    /// By scatter (`SCATTER` in recurrence.cu) in the 8-row and fused forms.
    On,
    /// By scatter, and the (8, 1) form bounded to 64 registers (8 blocks a multiprocessor)
    /// where d_k <= 128.
    Registers64,
}

/// Accumulator precision of the f32-storage chunked prefill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkAccumulate {
    /// Dot products and chunk sums in f32.
    F32,
    /// Dot products and chunk sums in f64, as the CPU twin does (each stage rounds once).
    F64,
}

/// Largest head sizes the chunked kernels' shared-memory tiles are sized for.
pub const MAX_CHUNK_HEAD_DIM: usize = 256;

const CHUNK: usize = crate::kernels::gated_delta::DELTA_RULE_CHUNK;
/// State rows per block of the chunked state pass, by default; 8 and 16 are compiled.
pub const CHUNK_STATE_ROWS: usize = 16;
const CHUNK_THREADS: u32 = 256;

fn prepare_smem(d_k: usize, d_v: usize) -> usize {
    8 * CHUNK + 4 * (2 * CHUNK + CHUNK * (CHUNK + 1) + CHUNK * (d_k + 1) + CHUNK * (d_k.max(d_v) + 1))
}

fn state_smem(d_k: usize, bv: usize) -> usize {
    4 * (CHUNK * (d_k + 1) + bv * (d_k + 1) + CHUNK * (bv + 1) + CHUNK * (CHUNK + 1) + 2 * CHUNK)
}

/// Head sizes of the fast mode (chunked_tc.cu instantiates each pair).
pub const FAST_CHUNK_HEAD_DIMS: [usize; 2] = [64, 128];
/// State rows (value columns) per block of the fast mode's state pass.
const TC_STATE_ROWS: usize = 32;
/// Most segments a sequence's chunks are cut into for the state pass ([`FastVariant::segments`]).
const MAX_STATE_SEGMENTS: usize = 16;
/// Fewest chunks a segment of the state pass has (`tern_gdn_tc_seg_min` in chunked_tc.cu).
const STATE_SEGMENT_MIN_CHUNKS: usize = 8;

/// Segments each sequence's chunks are cut into for the state pass: those asked, or as many as
/// the `blocks` of one segment fit on the multiprocessors (a block each), at most
/// [`MAX_STATE_SEGMENTS`], and no more than give the longest sequence's `longest_chunks`
/// [`STATE_SEGMENT_MIN_CHUNKS`] each; at least 1. (The kernel cuts each sequence by the same
/// rule for its own length.)
fn state_segment_count(asked: Option<usize>, multiprocessors: usize, blocks: usize, longest_chunks: usize) -> usize {
    let fill = asked.unwrap_or(multiprocessors / blocks.max(1));
    fill.min(MAX_STATE_SEGMENTS).min(longest_chunks / STATE_SEGMENT_MIN_CHUNKS).max(1)
}
/// How the fast mode's kernels are built. Every variant computes the same bits (a device test
/// checks it) but those on the warpgroup products, which may order their partial sums
/// otherwise, and those in segments, whose early-started segments may differ by up to 2^-30
/// of the state (device tests bound both); only the speed differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FastVariant {
    /// Rows of q, k and v a warp of the prepare pass fetches at once: 1, or 8 with v
    /// prefetched into L2.
    pub rows: usize,
    /// Chunks of operands the state pass keeps in flight: 2 or 3.
    pub stages: usize,
    /// The prepare pass's compact shared-memory layout (arrays whose lives do not meet share
    /// room: three blocks a multiprocessor where the wide layout fits two).
    pub compact: bool,
    /// The state pass issues a chunk's copies of the chunk `stages - 1` ahead after its first
    /// products instead of before them (3 stages only).
    pub late_issue: bool,
    /// The prepare pass's stores in whole 16-byte pieces and T's scaled copies two columns a
    /// store (`TILED` in chunked_tc.cu; compact layout, 8 rows only).
    pub tiled: bool,
    /// The state pass in thread block clusters: 2 (or 4) blocks of a value head share each
    /// chunk's W, q, k and read-out tiles (bulk copies multicast into the cluster) instead of
    /// each reading them from L2 (`MC` in chunked_tc.cu; 3 stages; sm_90 and later,
    /// [`GatedDeltaCuda::fast_variants`]). Slower than the blocks alone on an H100 (1.27 against
    /// 0.99 ms at 32k tokens, BENCHMARKS.md, twenty-seventh session): opt-in.
    pub cluster: bool,
    /// The state pass's products on the warpgroup tensor cores (wgmma, `tern_gdn_tc_state_wg_body`
    /// in chunked_tc.cu): each tile read once by four warps instead of by each warp. sm_90 only
    /// (H100, H200), d_k 128, 3 stages with late copies, not in clusters. Its products may
    /// round their partial sums in another order than mma.sync's, so it is compared with the
    /// others within a bound instead of bit for bit.
    pub warpgroup: bool,
    /// With `warpgroup`: the state pass transposed (`tern_gdn_tc_state_t_body`): one warpgroup
    /// a block for 64 state rows, holding S^T in its update's accumulators, every product's A
    /// operand in registers and its B operand a stage tile as stored, so that no tile goes
    /// through shared memory between a chunk's products and no barrier orders them. The same
    /// bits as the warpgroup form on an H100, but slower there (state pass 1.67 against 0.73
    /// ms at 32k tokens, BENCHMARKS.md, thirty-second session): one warpgroup a multiprocessor
    /// (64 blocks for 32 heads) has nothing to run while its products, copies and stores wait.
    /// Opt-in: the base of a block with a copying warp and two such warpgroups taking turns.
    pub transposed: bool,
    /// State rows a block of the state pass: 32; with `warpgroup` (not transposed) also 64, so
    /// that each chunk's shared tiles (W, q, k, the read-out weights), fetched from L2 by every
    /// block of a head, serve twice the rows, and a head takes half the blocks. The same bits.
    /// (128, two pairs of warpgroups sharing two stages at 128 registers, was slower still
    /// alone and in segments: BENCHMARKS.md, thirty-third session.)
    pub state_rows: usize,
    /// With `warpgroup` (not transposed), where q and k are L2-normalised: the state pass cuts
    /// each sequence's chunks into segments walked side by side when its blocks would leave
    /// multiprocessors idle (`tern_gdn_tc_state_wg_body` in chunked_tc.cu). A segment starts
    /// from zeros a few chunks early where the decays over those chunks have shrunk what came
    /// before to at most 2^-30 of the state (below f32's rounding of it); elsewhere it waits for
    /// the segment before it (the serial walk's bits).
    pub segments: bool,
}

const fn fast(rows: usize, stages: usize, compact: bool, late_issue: bool) -> FastVariant {
    FastVariant { rows, stages, compact, late_issue, tiled: false, cluster: false, warpgroup: false, transposed: false, state_rows: 32, segments: false }
}

/// The fast variants compiled (those in clusters only for devices that launch clusters).
pub const FAST_VARIANTS: [FastVariant; 15] = [
    fast(1, 2, false, false),
    fast(8, 2, false, false),
    fast(1, 3, false, false),
    fast(8, 3, false, false),
    fast(1, 3, true, false),
    fast(8, 3, true, false),
    fast(8, 3, false, true),
    fast(8, 3, true, true),
    FAST_VARIANT_MMA,
    FastVariant { cluster: true, ..FAST_VARIANT_MMA },
    FAST_VARIANT_WG,
    FastVariant { transposed: true, ..FAST_VARIANT_WG },
    FastVariant { state_rows: 64, ..FAST_VARIANT_WG },
    FastVariant { segments: true, ..FAST_VARIANT_WG },
    FAST_VARIANT,
];
/// The default fast variant on an sm_90 GPU: [`FAST_VARIANT_WG`]'s state pass in blocks of 64
/// state rows, each sequence's chunks in segments walked side by side where the decay allows
/// (within 2^-30 of the state; the same bits elsewhere). On an H100 at 32k tokens (Qwen3.5-35B-A3B's
/// layer: 64 blocks, so two segments): state pass 0.58 against 0.78 ms, 1.61 against 1.81 ms
/// in all (0.69 of fla's graph time); 8k 0.448 against 0.488; 2k level (BENCHMARKS.md,
/// thirty-third session). Elsewhere, and for head sizes other than d_k 128, the state pass is
/// FAST_VARIANT_MMA's.
pub const FAST_VARIANT: FastVariant = FastVariant { state_rows: 64, segments: true, ..FAST_VARIANT_WG };

/// The state pass on the warpgroup tensor cores, 32 state rows a block, one segment a sequence:
/// [`FAST_VARIANT_MMA`]'s bits (on an H100 at 32k tokens: state pass 0.766 against 0.872 ms,
/// 1.820 against 1.933 ms in all; 8k 0.497 against 0.526; BENCHMARKS.md, thirtieth session).
pub const FAST_VARIANT_WG: FastVariant = FastVariant { warpgroup: true, ..FAST_VARIANT_MMA };

/// The default fast variant where there are no warpgroup products: the compact prepare layout (three blocks a multiprocessor), TILED,
/// with the state pass's late copies: the fastest at 2k, 8k and 32k tokens. Untiled it was the
/// fastest on the H200 (2026-12-05, BENCHMARKS.md: 2.495 ms against 2.796 ms for
/// (8, 3, false, false) at 32k); tiling took its prepare pass from 1.322 to 1.182 ms at 32k on
/// an H100 (2.464 -> 2.321 ms in all; 0.195 -> 0.182 at 2k, 0.646 -> 0.618 at 8k), the same bits.
/// The state pass's operands stored as it keeps them (unpadded, then in 8 x 8 blocks) took it
/// from 1.137 to 0.991–0.997 ms at 32k on an H100 (2.309 -> 2.136–2.142 ms in all). Rows
/// fetched one vector a lane took the prepare pass from 1.16 to 1.04 ms, and the state pass's
/// fragments loaded a k-step ahead took it from 1.01 to 0.87 ms (1.89–1.94 ms in all at 32k,
/// 0.80–0.82 of fla's graph time on the same H100; BENCHMARKS.md, twenty-eighth session).
pub const FAST_VARIANT_MMA: FastVariant = FastVariant { tiled: true, ..fast(8, 3, true, true) };

/// Bytes of `tern_gdn_tc_prepare_body`'s shared memory (`tern_gdn_tc_prep_smem` in
/// chunked_tc.cu): G (f64), beta and e^G, then A and T (f32 rows of 72, the partials of T's
/// off-diagonal blocks inside A), k, q, v and the two scaled copies of T (bf16 rows padded by
/// 8) apart (wide) or with Q under T and the copies of T under A (compact).
fn tc_prepare_smem(d_k: usize, d_v: usize, compact: bool) -> usize {
    let scalars = 8 * CHUNK + 4 * 2 * CHUNK;
    let mat = 4 * CHUNK * (CHUNK + 8);
    let (k_rows, v_rows, t_copy) = (2 * CHUNK * (d_k + 8), 2 * CHUNK * (d_v + 8), 2 * CHUNK * 72);
    if compact {
        scalars + k_rows + v_rows + k_rows.max(mat) + mat.max(2 * t_copy)
    } else {
        scalars + 2 * mat + 2 * k_rows + v_rows + 2 * t_copy
    }
}

/// `sizeof(tern_gdn_tc_state_smem<d_k, stages>)`: per stage W, Q, K (bf16 tiles of d_k columns,
/// K transposed, in 8 x 8 blocks as the prepare pass stores them), the read-out weights, the U slice and
/// the decays; then the state copy and the two Delta tiles (rows padded by 8); in clusters
/// (`tern_gdn_tc_state_smem_mc`) two barriers a stage after them.
fn tc_state_smem(d_k: usize, stages: usize, cluster: bool) -> usize {
    stages * tc_stage_bytes(d_k) + 2 * (TC_STATE_ROWS * (d_k + 8) + 2 * TC_STATE_ROWS * 72) + if cluster { 2 * 8 * stages } else { 0 }
}

/// One stage of the state pass's operands: W, q, k (d_k wide), the read-out weights, the U
/// slice (bf16) and the decays (f32).
fn tc_stage_bytes(d_k: usize) -> usize {
    2 * (3 * CHUNK * d_k + CHUNK * CHUNK + CHUNK * TC_STATE_ROWS) + 4 * 2 * CHUNK
}

/// The warpgroup state pass's shared memory (`tern_gdn_tc_state_wg_smem`, d_k 128, `rows` state
/// rows a block): three stages (U's slices of 32 rows each), the state copy and Delta twice,
/// unpadded (in blocks), then 48 bytes of a segment's scalars (its ticket and walk back).
fn tc_state_wg_smem(rows: usize) -> usize {
    let extra_u = 2 * CHUNK * (rows - TC_STATE_ROWS);
    3 * (tc_stage_bytes(128) + extra_u) + 2 * (rows * 128 + 2 * rows * CHUNK) + 48
}

/// The transposed state pass's shared memory (d_k 128): three stages, each with U's two
/// slices of 32 rows; nothing else (its tiles between products stay in registers).
fn tc_state_t_smem() -> usize {
    3 * (tc_stage_bytes(128) + 2 * CHUNK * TC_STATE_ROWS)
}

/// Bytes of the fast prefill's operands for its state pass, by region of the chunk scratch:
/// bf16 W, U, read-out weights (per value head and chunk), normalised q, k (per key head and
/// chunk), each a whole number of 16-byte pieces; then the f32 decays.
fn fast_operand_regions(heads: &DeltaRuleHeads, n_chunks: usize) -> [usize; 6] {
    let DeltaRuleHeads { n_k_heads, n_v_heads, d_k, d_v, .. } = *heads;
    let (per, per_k) = (n_chunks * n_v_heads, n_chunks * n_k_heads);
    [per * CHUNK * d_k * 2, per * CHUNK * d_v * 2, per * CHUNK * CHUNK * 2, per_k * CHUNK * d_k * 2, per_k * CHUNK * d_k * 2, per * 2 * CHUNK * 4]
}

/// Bytes the fast prefill's prepare pass writes for its state pass to read over `tokens` tokens
/// of one sequence (the chunk scratch it fills).
pub fn fast_operand_bytes(heads: &DeltaRuleHeads, tokens: usize) -> usize {
    fast_operand_regions(heads, tokens.div_ceil(CHUNK)).iter().sum()
}

/// Mirrors `tern_gdn_tc_prep_args` in chunked_tc.cu field for field (C layout).
#[repr(C)]
#[derive(Clone, Copy)]
struct TcPrepArgs {
    q: u64,
    q_stride: i64,
    k: u64,
    k_stride: i64,
    v: u64,
    v_stride: i64,
    g: u64,
    beta: u64,
    chunk_t0: u64,
    chunk_len: u64,
    w_s: u64,
    u_s: u64,
    qk_s: u64,
    dec_s: u64,
    qn_s: u64,
    kn_s: u64,
    ctl: u64,
    nk: i32,
    nv: i32,
    grouped: i32,
    l2qk: i32,
    eps: f32,
    q_scale: f32,
    ctl_len: i32,
}
// SAFETY: plain old data of device pointers and scalars, laid out as the C struct.
unsafe impl DeviceRepr for TcPrepArgs {}

/// Mirrors `tern_gdn_tc_state_args` in chunked_tc.cu field for field (C layout).
#[repr(C)]
#[derive(Clone, Copy)]
struct TcStateArgs {
    states: u64,
    out: u64,
    w_s: u64,
    u_s: u64,
    qk_s: u64,
    dec_s: u64,
    qn_s: u64,
    kn_s: u64,
    seg_chunk0: u64,
    seg_nchunks: u64,
    chunk_t0: u64,
    chunk_len: u64,
    slot: u64,
    state_at: u64,
    boundary: u64,
    ctl: u64,
    nk: i32,
    nv: i32,
    dv: i32,
    grouped: i32,
    segments: i32,
}
// SAFETY: as TcPrepArgs.
unsafe impl DeviceRepr for TcStateArgs {}

/// The chunk table of a packed batch on the device: every segment cut into chunks of 64 from
/// its start; sequence s owns chunks `seg_chunk0[s] ..` (`seg_nchunks[s]` of them).
struct ChunkTable {
    n_chunks: usize,
    seg_chunk0: CudaSlice<u32>,
    seg_nchunks: CudaSlice<u32>,
    chunk_t0: CudaSlice<u32>,
    chunk_len: CudaSlice<u32>,
}

impl ChunkTable {
    /// None when the batch has no tokens.
    fn new(gpu: &Gpu, segs: &GpuSegments) -> Result<Option<Self>> {
        let (mut seg_chunk0, mut seg_nchunks, mut chunk_t0, mut chunk_len) = (vec![], vec![], vec![], vec![]);
        for seg in segs.segments() {
            seg_chunk0.push(chunk_t0.len() as u32);
            let mut t = seg.start;
            while t < seg.start + seg.len {
                let len = CHUNK.min(seg.start + seg.len - t);
                chunk_t0.push(t as u32);
                chunk_len.push(len as u32);
                t += len;
            }
            seg_nchunks.push(chunk_t0.len() as u32 - seg_chunk0.last().unwrap());
        }
        let n_chunks = chunk_t0.len();
        if n_chunks == 0 {
            return Ok(None);
        }
        Ok(Some(ChunkTable {
            n_chunks,
            seg_chunk0: gpu.upload(&seg_chunk0)?,
            seg_nchunks: gpu.upload(&seg_nchunks)?,
            chunk_t0: gpu.upload(&chunk_t0)?,
            chunk_len: gpu.upload(&chunk_len)?,
        }))
    }
}

/// Mirrors `tern_gdn_chunk_args` in chunked.cu field for field (C layout).
#[repr(C)]
#[derive(Clone, Copy)]
struct ChunkArgs {
    q: u64,
    q_stride: i64,
    k: u64,
    k_stride: i64,
    v: u64,
    v_stride: i64,
    g: u64,
    beta: u64,
    chunk_t0: u64,
    chunk_len: u64,
    w_s: u64,
    u_s: u64,
    qk_s: u64,
    dec_s: u64,
    nk: i32,
    nv: i32,
    dk: i32,
    dv: i32,
    grouped: i32,
    l2qk: i32,
    eps: f32,
    q_scale: f32,
}
// SAFETY: plain old data of device pointers and scalars, laid out as the C struct.
unsafe impl DeviceRepr for ChunkArgs {}

/// Mirrors `tern_gdn_state_args` in chunked.cu field for field (C layout).
#[repr(C)]
#[derive(Clone, Copy)]
struct StateArgs {
    states: u64,
    q: u64,
    q_stride: i64,
    k: u64,
    k_stride: i64,
    w_s: u64,
    u_s: u64,
    qk_s: u64,
    dec_s: u64,
    out: u64,
    seg_chunk0: u64,
    seg_nchunks: u64,
    chunk_t0: u64,
    chunk_len: u64,
    slot: u64,
    state_at: u64,
    nk: i32,
    nv: i32,
    dk: i32,
    dv: i32,
    grouped: i32,
    l2qk: i32,
    eps: f32,
    q_scale: f32,
}
// SAFETY: as ChunkArgs.
unsafe impl DeviceRepr for StateArgs {}

/// Kernel widths the conv kernel is instantiated for.
pub const MAX_CONV_WIDTH: usize = 8;
/// Positions one conv thread walks (conv.cu): enough to amortise reloading the history, few
/// enough that a prompt spreads over the whole GPU.
const CONV_CHUNK: usize = 64;

impl GatedDeltaCuda {
    /// Compiles (or takes from the cache) and loads every kernel of the family.
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        let conv = (1..=MAX_CONV_WIDTH).map(|kw| gpu.function(&CONV, &format!("tern_gdn_conv_k{kw}"))).collect::<Result<_>>()?;
        let recurrence = RecurrenceKernel::all().into_iter().map(|k| Ok((k, gpu.function(&RECURRENCE, &k.name())?))).collect::<Result<_>>()?;
        let with_smem = |src: &KernelSource, name: &str, smem: usize| -> Result<CudaFunction> {
            let f = gpu.function(src, name)?;
            f.set_attribute(MAX_DYN_SMEM, smem as i32).map_err(driver_err(&format!("{name}: raising its shared memory to {smem} bytes")))?;
            Ok(f)
        };
        let f = |name: &str, smem: usize| with_smem(&CHUNKED, name, smem);
        let fc = |name: &str, smem: usize| with_smem(&CHUNKED_TC, name, smem);
        let (ps, ss) = (prepare_smem(MAX_CHUNK_HEAD_DIM, MAX_CHUNK_HEAD_DIM), state_smem(MAX_CHUNK_HEAD_DIM, 16));
        let chunk_prepare = [f("tern_gdn_chunk_prepare_f32", ps)?, f("tern_gdn_chunk_prepare_f64", ps)?];
        let chunk_state = [
            [f("tern_gdn_chunk_state_f32_bv8", ss)?, f("tern_gdn_chunk_state_f32_bv16", ss)?],
            [f("tern_gdn_chunk_state_f64_bv8", ss)?, f("tern_gdn_chunk_state_f64_bv16", ss)?],
        ];
        let (mut tc_prepare, mut tc_state, mut tc_prepare_bf16, mut tc_state_bf16) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for dk in FAST_CHUNK_HEAD_DIMS {
            for rows in [1, 8] {
                for dv in FAST_CHUNK_HEAD_DIMS {
                    for compact in [false, true] {
                        let name = format!("tern_gdn_tc_prepare_dk{dk}_dv{dv}_r{rows}{}", if compact { "c" } else { "" });
                        tc_prepare.push(((dk, dv, rows, compact, false), fc(&name, tc_prepare_smem(dk, dv, compact))?));
                    }
                    if rows == 8 {
                        let name = format!("tern_gdn_tc_prepare_dk{dk}_dv{dv}_r8ct");
                        tc_prepare.push(((dk, dv, rows, true, true), fc(&name, tc_prepare_smem(dk, dv, true))?));
                        let name = format!("tern_gdn_tc_prepare_dk{dk}_dv{dv}_r8ctb");
                        tc_prepare_bf16.push(((dk, dv), fc(&name, tc_prepare_smem(dk, dv, true))?));
                    }
                }
            }
            for (stages, late) in [(2, false), (3, false), (3, true)] {
                let name = format!("tern_gdn_tc_state_dk{dk}_s{stages}{}", if late { "l" } else { "" });
                tc_state.push(((dk, stages, late, false, false, false, 32), fc(&name, tc_state_smem(dk, stages, false))?));
            }
            tc_state_bf16.push(((dk, false, 32), fc(&format!("tern_gdn_tc_state_dk{dk}_s3lb"), tc_state_smem(dk, 3, false))?));
            // Compiled for sm_90 and later only (chunked_tc.cu).
            if gpu.cluster_launch()? {
                let name = format!("tern_gdn_tc_state_dk{dk}_s3lm");
                tc_state.push(((dk, 3, true, true, false, false, 32), fc(&name, tc_state_smem(dk, 3, true))?));
            }
            // The warpgroup products exist on sm_90 only (compiled there for sm_90a).
            if dk == 128 && gpu.warpgroup_products() {
                // By state rows a block: _s3lw (32), _s3lw2 (64); b: bf16 output.
                for (rows, name) in [(32, "s3lw"), (64, "s3lw2")] {
                    let smem = tc_state_wg_smem(rows);
                    tc_state.push(((dk, 3, true, false, true, false, rows), fc(&format!("tern_gdn_tc_state_dk128_{name}"), smem)?));
                    tc_state_bf16.push(((dk, true, rows), fc(&format!("tern_gdn_tc_state_dk128_{name}b"), smem)?));
                }
                tc_state.push(((dk, 3, true, false, true, true, 32), fc("tern_gdn_tc_state_dk128_s3lt", tc_state_t_smem())?));
            }
        }
        Ok(GatedDeltaCuda {
            tc_prepare,
            tc_state,
            tc_prepare_bf16,
            tc_state_bf16,
            fast_variant: if gpu.warpgroup_products() { FAST_VARIANT } else { FAST_VARIANT_MMA },
            state_segments: std::env::var("TERN_GDN_STATE_SEGMENTS").ok().and_then(|v| v.parse().ok()).filter(|n| *n > 0),
            cluster_blocks: match std::env::var("TERN_GDN_CLUSTER_BLOCKS").as_deref() {
                Ok("4") => 4,
                Ok("1") => 1,
                _ => 2,
            },
            chunk_prepare,
            chunk_state,
            chunk_scratch: Mutex::new(None),
            chunk_prepare_only: false,
            chunk_state_rows: CHUNK_STATE_ROWS,
            gates: gpu.function(&GATES, "tern_gdn_gates")?,
            normalize_qk: gpu.function(&NORM, "tern_gdn_normalize_qk")?,
            gated_norm: gpu.function(&NORM, "tern_gdn_gated_rms_norm")?,
            conv,
            recurrence,
            fused_bound64: std::env::var("TERN_GDN_FUSED_BOUND").map_or(true, |v| v != "0"),
            direct_addressing: std::env::var("TERN_GDN_DIRECT").map_or(true, |v| v != "0"),
            early_state: (std::env::var("TERN_GDN_EARLY_STATE").as_deref() == Ok("0")).then_some(false),
            scatter: match std::env::var("TERN_GDN_SCATTER").as_deref() {
                Ok("0") => ScatterSums::Off,
                Ok("64") => ScatterSums::Registers64,
                _ => ScatterSums::On,
            },
            recurrence_variant: None,
            recurrence_block_warps: RECURRENCE_BLOCK_WARPS,
            gpu,
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Segments of a sequence's chunks the fast state pass walks side by side where its variant
    /// has [`FastVariant::segments`]: `Some(n)` asks for n (fewer where a sequence has fewer than
    /// 8 chunks a segment; at most 16), None for as many as fill the device's multiprocessors.
    pub fn set_state_segments(&mut self, n: Option<usize>) -> Result<()> {
        if n == Some(0) {
            return Err(Error::Input("state segments: at least 1".into()));
        }
        self.state_segments = n;
        Ok(())
    }

    /// Benchmark aid: with `true`, [`Self::delta_rule_chunked`] runs only its parallel
    /// per-chunk pass and leaves outputs and states unfinished.
    #[doc(hidden)]
    pub fn set_chunk_prepare_only(&mut self, on: bool) {
        self.chunk_prepare_only = on;
    }

    /// State rows per block of the chunked prefill's state pass: 8 or 16. Only the split of
    /// the work over blocks changes (bit-identical results); fewer rows give more blocks.
    pub fn set_chunk_state_rows(&mut self, rows: usize) -> Result<()> {
        if rows != 8 && rows != 16 {
            return Err(Error::Input(format!("chunk state rows {rows}: expected 8 or 16")));
        }
        self.chunk_state_rows = rows;
        Ok(())
    }

    /// The fast variants this device runs: [`FAST_VARIANTS`] less those in clusters where the
    /// device cannot launch clusters, and the warpgroup one where it has no warpgroup products.
    pub fn fast_variants(&self) -> Vec<FastVariant> {
        let has = |v: &FastVariant| {
            self.tc_state.iter().any(|((_, stages, late, cluster, wg, t, rows), _)| {
                (*stages, *late, *cluster, *wg, *t, *rows) == (v.stages, v.late_issue, v.cluster, v.warpgroup, v.transposed, v.state_rows)
            })
        };
        FAST_VARIANTS.into_iter().filter(has).collect()
    }

    /// The fast variant a new instance runs: [`FAST_VARIANT`] where the warpgroup products exist,
    /// else [`FAST_VARIANT_MMA`].
    pub fn default_fast_variant(&self) -> FastVariant {
        if self.gpu.warpgroup_products() {
            FAST_VARIANT
        } else {
            FAST_VARIANT_MMA
        }
    }

    /// Selects how the fast mode's kernels are built (one of [`Self::fast_variants`]); results
    /// are bit-identical for every choice but [`FastVariant::warpgroup`] and
    /// [`FastVariant::segments`] (within a bound).
    pub fn set_fast_variant(&mut self, variant: FastVariant) -> Result<()> {
        let offered = self.fast_variants();
        if !offered.contains(&variant) {
            let why = match (FAST_VARIANTS.contains(&variant), variant.warpgroup) {
                (true, true) => " on this device (warpgroup products need an sm_90 GPU)",
                (true, false) => " on this device (it launches no thread block clusters)",
                _ => "",
            };
            return Err(Error::Input(format!("fast variant {variant:?}: not available{why}; expected one of {offered:?}")));
        }
        self.fast_variant = variant;
        Ok(())
    }

    /// Selects how the recurrence spreads state rows over warps (one of
    /// [`RECURRENCE_VARIANTS`], or None for the defaults by batch); results are bit-identical
    /// for every choice.
    pub fn set_recurrence_variant(&mut self, variant: Option<(usize, usize)>) -> Result<()> {
        if let Some(v) = variant.filter(|v| !RECURRENCE_VARIANTS.contains(v)) {
            return Err(Error::Input(format!("recurrence variant {v:?}: expected one of {RECURRENCE_VARIANTS:?}")));
        }
        self.recurrence_variant = variant;
        Ok(())
    }

    /// Whether the recurrence's 8-row forms and its fused form sum their rows by scatter
    /// (`SCATTER` in recurrence.cu) rather than one butterfly a row: the same bits, fewer
    /// shuffles; the other forms keep the butterflies.
    pub fn set_scatter_sums(&mut self, how: ScatterSums) {
        self.scatter = how;
    }

    /// Whether the fused form runs bounded to two blocks a multiprocessor where d_k <= 128 (the
    /// same bits, with the butterflies or the scatter sums as [`Self::set_scatter_sums`] says).
    pub fn set_fused_bound64(&mut self, on: bool) {
        self.fused_bound64 = on;
    }

    /// Whether every recurrence launch requests its first state rows before it awaits the
    /// kernel before it (EARLY_STATE), whatever `Gpu::state_reads_may_lead` says: the device
    /// tests check that path's bits. Without dependent launch it changes only the order.
    #[cfg(test)]
    pub(crate) fn set_early_state(&mut self, on: bool) {
        self.early_state = Some(on);
    }

    /// Whether the recurrence computes a state's address and a decode token's row where the
    /// batch allows it (consecutive slots, one token a sequence) instead of loading them from the
    /// batch's tables. The same bits either way.
    pub fn set_direct_addressing(&mut self, on: bool) {
        self.direct_addressing = on;
    }

    /// Warps per block of the unfused recurrence (one of [`RECURRENCE_BLOCK_WARP_CHOICES`]);
    /// the warps of a block share nothing, so results are bit-identical for every choice.
    pub fn set_recurrence_block_warps(&mut self, warps: u32) -> Result<()> {
        if !RECURRENCE_BLOCK_WARP_CHOICES.contains(&warps) {
            return Err(Error::Input(format!("recurrence block of {warps} warps: expected one of {RECURRENCE_BLOCK_WARP_CHOICES:?}")));
        }
        self.recurrence_block_warps = warps;
        Ok(())
    }

    /// `g = a·softplus(alpha + dt_bias)` and `β = sigmoid(b)` in one pass; `alpha`, `b`, `g`,
    /// `beta` are `[rows][n_heads]`, `dt_bias` and `a` `[n_heads]`. CPU twins:
    /// [`super::decay_gate`], [`super::beta_gate`].
    pub fn gates(
        &self,
        alpha: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
        a: &CudaSlice<f32>,
        g: &mut CudaSlice<f32>,
        beta: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let n_heads = a.len();
        check_len("gates dt_bias", dt_bias.len(), n_heads)?;
        if n_heads == 0 || alpha.len() % n_heads != 0 {
            return Err(Error::Shape(format!("gates: {} elements are not rows of {n_heads} heads", alpha.len())));
        }
        check_len("gates b", b.len(), alpha.len())?;
        check_len("gates g", g.len(), alpha.len())?;
        check_len("gates beta", beta.len(), alpha.len())?;
        let total = alpha.len() as i64;
        let nh = i32_of("gates heads", n_heads)?;
        let cfg = LaunchConfig { grid_dim: (grid_1d(alpha.len(), ELEMENT_BLOCK)?, 1, 1), block_dim: (ELEMENT_BLOCK, 1, 1), shared_mem_bytes: 0 };
        if total == 0 {
            return Ok(());
        }
        let mut l = self.gpu.launch_builder(&self.gates);
        l.buf(alpha).buf(b).buf(dt_bias).buf(a).buf(g).buf(beta).arg(&nh).arg(&total);
        // SAFETY: argument types match tern_gdn_gates; every index is < total (checked lengths).
        unsafe { l.launch(cfg) }.map_err(launch_err("launching tern_gdn_gates"))?;
        Ok(())
    }

    /// Causal conv1d + SiLU over a packed batch (decode: [`GpuSegments::decode`]). `x` and
    /// `out` are `[tokens][channels]`, `weight` `[channels][K]`, `conv_states` a pool of
    /// `[channels][K − 1]` raw-input histories. CPU twins: [`super::conv1d_silu_scan`],
    /// [`super::conv1d_silu_step`].
    pub fn conv1d_silu(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        kernel_width: usize,
        segs: &GpuSegments,
        mut conv_states: GpuStates,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if kernel_width == 0 || kernel_width > MAX_CONV_WIDTH || weight.is_empty() || weight.len() % kernel_width != 0 {
            return Err(Error::Shape(format!(
                "conv1d_silu weight: {} elements are not channels of width {kernel_width} (1..={MAX_CONV_WIDTH})",
                weight.len()
            )));
        }
        let channels = weight.len() / kernel_width;
        check_len("conv1d_silu input", x.len(), segs.tokens * channels)?;
        check_len("conv1d_silu output", out.len(), x.len())?;
        let taps = kernel_width - 1;
        if segs.n_seqs() == 0 {
            return Ok(());
        }
        // Width 1 keeps no history: no state to check (the kernel reads none).
        let (pool, table) = if taps > 0 {
            let (pool, table, _) = conv_states.resolve(&self.gpu, "conv1d_silu conv states", segs, channels * taps)?;
            (pool, table)
        } else {
            (0, None)
        };
        let ch = i32_of("conv channels", channels)?;
        // Positions per thread: a prompt's positions spread over many threads (see conv.cu);
        // at least the history length, so a later chunk's history lies in its own sequence.
        let chunk = CONV_CHUNK.max(MAX_CONV_WIDTH);
        let longest = segs.segments().iter().map(|s| s.len).max().unwrap_or(0);
        let chunks = u32::try_from(longest.div_ceil(chunk).max(1)).ok().filter(|&n| n <= 65_535).ok_or_else(|| {
            Error::Shape(format!("conv1d_silu: a segment of {longest} positions (at most {} per launch)", 65_535 * chunk))
        })?;
        let cfg = LaunchConfig {
            grid_dim: (grid_1d(channels, 128)?, segs.n_seqs() as u32, chunks),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let chunk_arg = chunk as i32;
        let f = &self.conv[kernel_width - 1];
        let mut l = self.gpu.launch_builder(f);
        let table_at = self.gpu.ptr_opt(table.as_deref());
        l.buf(x).buf(weight).arg(&pool).buf(out).buf(&segs.start).buf(&segs.len).buf(&segs.slot).arg(&table_at).arg(&ch).arg(&chunk_arg);
        // SAFETY: argument types match tern_gdn_conv_k*; segments lie inside the rows and slots
        // inside the pool (checked), a chunk after the first reads the K - 1 rows before it in its
        // own segment (chunk >= MAX_CONV_WIDTH), only the first chunk's thread reads and writes
        // a state, and with K = 1 the kernel never touches the state.
        unsafe { l.launch(cfg) }.map_err(launch_err("launching tern_gdn_conv"))?;
        Ok(())
    }

    /// In place on `[rows][d_k]` buffers: both L2-normalised (eps 1e−6), q scaled by `1/√d_k`.
    /// CPU twin: [`super::normalize_qk`].
    pub fn normalize_qk(&self, q: &mut CudaSlice<f32>, k: &mut CudaSlice<f32>, d_k: usize) -> Result<()> {
        check_len("normalize_qk k", k.len(), q.len())?;
        if d_k == 0 || q.len() % d_k != 0 {
            return Err(Error::Shape(format!("normalize_qk: {} elements are not rows of {d_k}", q.len())));
        }
        let rows = (q.len() / d_k) as i64;
        if rows == 0 {
            return Ok(());
        }
        let d = i32_of("normalize_qk d_k", d_k)?;
        let (eps, scale) = (L2_NORM_EPS, (1.0 / (d_k as f64).sqrt()) as f32);
        let cfg = LaunchConfig {
            grid_dim: (grid_1d(rows as usize, ROW_WARPS)?, 2, 1),
            block_dim: (32 * ROW_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.gpu.launch_builder(&self.normalize_qk);
        l.buf(q).buf(k).arg(&rows).arg(&d).arg(&eps).arg(&scale);
        // SAFETY: argument types match; rows × d_k elements in both buffers (checked).
        unsafe { l.launch(cfg) }.map_err(launch_err("launching tern_gdn_normalize_qk"))?;
        Ok(())
    }

    /// `out = rms(y)·w·silu(z)` per row of `w.len()`, w shared by every head. CPU twin:
    /// [`super::gated_rms_norm`].
    pub fn gated_rms_norm(
        &self,
        y: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let d = w.len();
        if d == 0 || y.len() % d != 0 {
            return Err(Error::Shape(format!("gated_rms_norm: {} elements are not rows of {d}", y.len())));
        }
        check_len("gated_rms_norm gate", z.len(), y.len())?;
        check_len("gated_rms_norm output", out.len(), y.len())?;
        let rows = (y.len() / d) as i64;
        if rows == 0 {
            return Ok(());
        }
        let di = i32_of("gated_rms_norm width", d)?;
        let cfg = LaunchConfig {
            grid_dim: (grid_1d(rows as usize, ROW_WARPS)?, 1, 1),
            block_dim: (32 * ROW_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.gpu.launch_builder(&self.gated_norm);
        l.buf(y).buf(z).buf(w).buf(out).arg(&rows).arg(&di).arg(&eps);
        // SAFETY: argument types match; rows × d elements in y, z, out and d in w (checked).
        unsafe { l.launch(cfg) }.map_err(launch_err("launching tern_gdn_gated_rms_norm"))?;
        Ok(())
    }

    fn check_inputs(&self, what: &str, heads: &DeltaRuleHeads, x: &GpuDeltaRuleInputs, segs: &GpuSegments, out: &CudaSlice<f32>) -> Result<()> {
        check_operands(what, heads, [&x.q, &x.k, &x.v], [x.g, x.beta], out.len(), segs.tokens)?;
        let t = segs.tokens;
        if let Some(f) = &x.fused {
            check_len(&format!("{what} dt_bias"), f.dt_bias.len(), heads.n_v_heads)?;
            check_len(&format!("{what} a"), f.a.len(), heads.n_v_heads)?;
            check_len(&format!("{what} norm weight"), f.norm.len(), heads.d_v)?;
            f.z.check(&format!("{what} z"), t, heads.n_v_heads * heads.d_v)?;
        }
        Ok(())
    }

    fn unfused(what: &str, x: &GpuDeltaRuleInputs) -> Result<()> {
        match x.fused {
            Some(_) => Err(Error::Shape(format!("{what}: the fused gates and norm are the recurrence's alone"))),
            None => Ok(()),
        }
    }

    /// The delta-rule recurrence over a packed batch: the sequential scan, and with
    /// [`GpuSegments::decode`] the decode step, through this one launcher and one kernel.
    /// `states` is a pool of transposed states (`[n_slots][n_v_heads][d_v][d_k]`); d_k must be
    /// 32, 64, 128 or 256 (the state row is split over a warp's registers). CPU twins:
    /// [`super::delta_rule_scan`], [`super::delta_rule_step`].
    pub fn delta_rule(
        &self,
        heads: &DeltaRuleHeads,
        x: &GpuDeltaRuleInputs,
        segs: &GpuSegments,
        mut states: GpuStates,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.check_inputs("delta_rule", heads, x, segs, out)?;
        let (rows, per_warp) = match x.fused {
            Some(_) => (FUSED_ROWS_PER_WARP, 1),
            None => self.recurrence_variant.unwrap_or({
                let decode = segs.segments.iter().all(|s| s.len == 1);
                if decode && segs.n_seqs() >= MANY_DECODE_SEQS { RECURRENCE_VARIANT_MANY } else { RECURRENCE_VARIANT }
            }),
        };
        if x.fused.is_some() && heads.d_v > FUSED_MAX_DV {
            return Err(Error::Shape(format!("delta_rule fused on CUDA: d_v = {} (at most {FUSED_MAX_DV})", heads.d_v)));
        }
        // The scatter sums exist for the 8-row forms and the fused one; the 64-register bounds
        // for the (8, 1) form with them and for the fused form, where d_k <= 128.
        let scatter = self.scatter != ScatterSums::Off;
        let small = heads.d_k <= 128;
        let want = match x.fused {
            Some(_) => RecurrenceKernel { d_k: heads.d_k, form: RecurrenceForm::Fused, scatter, bound64: self.fused_bound64 && small },
            None => RecurrenceKernel {
                d_k: heads.d_k,
                form: RecurrenceForm::Rows(rows, per_warp),
                scatter: scatter && rows == 8 && per_warp <= 2,
                bound64: self.scatter == ScatterSums::Registers64 && (rows, per_warp) == (8, 1) && small,
            },
        };
        let f = self.recurrence.iter().find(|(k, _)| *k == want).map(|(_, f)| f);
        let f = f.ok_or_else(|| Error::Shape(format!("delta_rule on CUDA: d_k = {} (supported: 32, 64, 128, 256)", heads.d_k)))?;
        if segs.n_seqs() == 0 {
            return Ok(());
        }
        let (pool, table, state_ranges) = states.resolve(&self.gpu, "delta_rule states", segs, heads.state_len())?;
        let groups = heads.d_v.div_ceil(rows);
        // The kernel numbers a sequence's row groups with 32-bit ints.
        i32_of("value heads × row groups", heads.n_v_heads * groups)?;
        let cfg = match x.fused {
            // One block of `groups` warps per (head, sequence): the norm meets a head's rows.
            Some(_) => LaunchConfig { grid_dim: (heads.n_v_heads as u32, segs.n_seqs() as u32, 1), block_dim: (32 * groups as u32, 1, 1), shared_mem_bytes: 0 },
            None => LaunchConfig {
                grid_dim: (grid_1d((heads.n_v_heads * groups).div_ceil(per_warp), self.recurrence_block_warps)?, segs.n_seqs() as u32, 1),
                block_dim: (32 * self.recurrence_block_warps, 1, 1),
                shared_mem_bytes: 0,
            },
        };
        let g = &self.gpu;
        let at = |r: &Rows| r.address(g);
        let fused = x.fused.as_ref();
        let args = RecurrenceArgs {
            states: pool,
            slot: g.ptr(&segs.slot),
            state_at: g.ptr_opt(table.as_deref()),
            q: at(&x.q),
            q_stride: x.q.stride as i64,
            k: at(&x.k),
            k_stride: x.k.stride as i64,
            v: at(&x.v),
            v_stride: x.v.stride as i64,
            g: g.ptr(x.g),
            beta: g.ptr(x.beta),
            out: g.ptr(out),
            seg_start: g.ptr(&segs.start),
            seg_len: g.ptr(&segs.len),
            dt_bias: g.ptr_opt(fused.map(|f| f.dt_bias)),
            a: g.ptr_opt(fused.map(|f| f.a)),
            z: fused.map_or(0, |f| at(&f.z)),
            z_stride: fused.map_or(0, |f| f.z.stride as i64),
            norm_w: g.ptr_opt(fused.map(|f| f.norm)),
            norm_eps: fused.map_or(0.0, |f| f.eps),
            nk: i32_of("key heads", heads.n_k_heads)?,
            nv: i32_of("value heads", heads.n_v_heads)?,
            dv: i32_of("d_v", heads.d_v)?,
            grouped: (heads.key_head == KeyHeadMap::Grouped) as i32,
            l2qk: x.normalize_qk as i32,
            eps: L2_NORM_EPS,
            q_scale: (1.0 / (heads.d_k as f64).sqrt()) as f32,
            slot_base: segs.first_slot,
            // With an address table the kernel takes each state from it and ignores the slots.
            direct: if self.direct_addressing { segs.direct } else { 0 } | if self.early_state.unwrap_or_else(|| g.state_reads_may_lead(&state_ranges)) { EARLY_STATE } else { 0 },
        };
        let mut l = g.launch_builder(f);
        l.arg(&args);
        // SAFETY: RecurrenceArgs mirrors tern_gdn_recurrence_args; every row, segment and slot
        // lies inside its buffer and each sequence's state has its length (checked above); the
        // address table stays alive in the device table cache after this returns.
        unsafe { l.launch(cfg) }.map_err(launch_err("launching tern_gdn_recurrence"))?;
        g.note_state_writer(state_ranges);
        Ok(())
    }
}

impl GatedDeltaCuda {
    /// The chunked prefill (chunk 64, UT transform) over a packed batch, with the operands,
    /// segments and state pool of [`Self::delta_rule`] and the same results to f32 rounding
    /// (its sequential scan is the oracle). `g` must be ≤ 0. d_k and d_v up to 256. CPU twin:
    /// [`super::delta_rule_chunked`].
    pub fn delta_rule_chunked(
        &self,
        heads: &DeltaRuleHeads,
        x: &GpuDeltaRuleInputs,
        segs: &GpuSegments,
        mut states: GpuStates,
        out: &mut CudaSlice<f32>,
        acc: ChunkAccumulate,
    ) -> Result<()> {
        self.check_inputs("delta_rule_chunked", heads, x, segs, out)?;
        Self::unfused("delta_rule_chunked", x)?;
        let (pool, state_table, state_ranges) = states.resolve(&self.gpu, "delta_rule_chunked states", segs, heads.state_len())?;
        let DeltaRuleHeads { n_k_heads, n_v_heads, d_k, d_v, key_head } = *heads;
        if d_k > MAX_CHUNK_HEAD_DIM || d_v > MAX_CHUNK_HEAD_DIM {
            return Err(Error::Shape(format!("delta_rule_chunked on CUDA: d_k {d_k}, d_v {d_v} (at most {MAX_CHUNK_HEAD_DIM})")));
        }
        let Some(table) = segs.chunk_table(&self.gpu)? else { return Ok(()) };
        let ChunkTable { n_chunks, seg_chunk0, seg_nchunks, chunk_t0, chunk_len } = table;
        let n_chunks = *n_chunks;
        let gpu = &self.gpu;

        let per = n_chunks * n_v_heads;
        let (w_len, u_len, qk_len, dec_len) = (per * CHUNK * d_k, per * CHUNK * d_v, per * CHUNK * CHUNK, per * 2 * CHUNK);
        let need = w_len + u_len + qk_len + dec_len;
        let scratch = self.scratch(need)?;
        let stream = gpu.stream();
        let base = gpu.ptr(&*scratch);
        let (w_s, u_s, qk_s, dec_s) = (base, base + 4 * w_len as u64, base + 4 * (w_len + u_len) as u64, base + 4 * (w_len + u_len + qk_len) as u64);
        let ptr = |r: &Rows| r.address(gpu);
        let (nk, nv, dk, dv) = (i32_of("key heads", n_k_heads)?, i32_of("value heads", n_v_heads)?, i32_of("d_k", d_k)?, i32_of("d_v", d_v)?);
        let grouped = (key_head == KeyHeadMap::Grouped) as i32;
        let l2qk = x.normalize_qk as i32;
        let (eps, q_scale) = (L2_NORM_EPS, (1.0 / (d_k as f64).sqrt()) as f32);
        let which = (acc == ChunkAccumulate::F64) as usize;

        let args = ChunkArgs {
            q: ptr(&x.q),
            q_stride: x.q.stride as i64,
            k: ptr(&x.k),
            k_stride: x.k.stride as i64,
            v: ptr(&x.v),
            v_stride: x.v.stride as i64,
            g: x.g.device_ptr(stream).0,
            beta: x.beta.device_ptr(stream).0,
            chunk_t0: chunk_t0.device_ptr(stream).0,
            chunk_len: chunk_len.device_ptr(stream).0,
            w_s,
            u_s,
            qk_s,
            dec_s,
            nk,
            nv,
            dk,
            dv,
            grouped,
            l2qk,
            eps,
            q_scale,
        };
        let cfg = LaunchConfig {
            grid_dim: (u32_of("chunks", n_chunks)?, n_v_heads as u32, 1),
            block_dim: (CHUNK_THREADS, 1, 1),
            shared_mem_bytes: prepare_smem(d_k, d_v) as u32,
        };
        let mut l = gpu.launch_builder(&self.chunk_prepare[which]);
        l.arg(&args);
        // SAFETY: ChunkArgs mirrors the kernel's struct; every pointer is a live buffer of the
        // length the shape checks above established, and the scratch holds every chunk-head.
        unsafe { l.launch(cfg) }.map_err(launch_err("launching tern_gdn_chunk_prepare"))?;
        if self.chunk_prepare_only {
            return Ok(());
        }

        let args = StateArgs {
            states: pool,
            q: args.q,
            q_stride: args.q_stride,
            k: args.k,
            k_stride: args.k_stride,
            w_s,
            u_s,
            qk_s,
            dec_s,
            out: out.device_ptr_mut(stream).0,
            seg_chunk0: seg_chunk0.device_ptr(stream).0,
            seg_nchunks: seg_nchunks.device_ptr(stream).0,
            chunk_t0: args.chunk_t0,
            chunk_len: args.chunk_len,
            slot: segs.slot.device_ptr(stream).0,
            state_at: self.gpu.ptr_opt(state_table.as_deref()),
            nk,
            nv,
            dk,
            dv,
            grouped,
            l2qk,
            eps,
            q_scale,
        };
        let cfg = LaunchConfig {
            grid_dim: (n_v_heads as u32, d_v.div_ceil(self.chunk_state_rows) as u32, segs.n_seqs() as u32),
            block_dim: (CHUNK_THREADS, 1, 1),
            shared_mem_bytes: state_smem(d_k, self.chunk_state_rows) as u32,
        };
        let mut l = gpu.launch_builder(&self.chunk_state[which][(self.chunk_state_rows == 16) as usize]);
        l.arg(&args);
        // SAFETY: as above; slots lie inside the state pool (checked).
        unsafe { l.launch(cfg) }.map_err(launch_err("launching tern_gdn_chunk_state"))?;
        gpu.note_state_writer(state_ranges);
        // The chunk tables are freed when this returns; the stream orders that free after the
        // launches that read them.
        Ok(())
    }

    /// The chunk scratch, at least `need` f32 elements long.
    fn scratch(&self, need: usize) -> Result<Arc<CudaSlice<f32>>> {
        let mut scratch = self.chunk_scratch.lock().unwrap_or_else(|p| p.into_inner());
        if scratch.as_ref().is_none_or(|s| s.len() < need) {
            // Free the old buffer before taking the larger one, unless a graph still holds it.
            *scratch = None;
            *scratch = Some(Arc::new(self.gpu.zeros::<f32>(need)?));
        }
        let buf = scratch.as_ref().expect("allocated above").clone();
        self.gpu.hold_while_recorded(&buf)?;
        Ok(buf)
    }

    /// Fast mode of [`Self::delta_rule_chunked`] (DESIGN.md §3): the same chunked algebra with
    /// every matrix product on the tensor cores, bf16 operands and f32 accumulation; the state
    /// stays f32 from chunk to chunk and in `states`. Its error against the f32 scan is
    /// measured by the device tests and the benchmark, not assumed (about 1e-2 relative, from
    /// the bf16 rounding of the operands). d_k and d_v must each be 64 or 128. The chunk
    /// scratch holds, per chunk of 64 tokens, W, U, the read-out weights and the decays of every
    /// value head and q, k of every key head (bf16): 1.8 MiB per chunk at 16/32 heads, d = 128.
    pub fn delta_rule_chunked_fast(
        &self,
        heads: &DeltaRuleHeads,
        x: &GpuDeltaRuleInputs,
        segs: &GpuSegments,
        states: GpuStates,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.check_inputs("delta_rule_chunked_fast", heads, x, segs, out)?;
        Self::unfused("delta_rule_chunked_fast", x)?;
        let out = self.gpu.ptr(out);
        let operands = FastOperands::new(&self.gpu, [&x.q, &x.k, &x.v], [x.g, x.beta], x.normalize_qk, out);
        self.chunked_fast("delta_rule_chunked_fast", heads, &operands, FastIo::F32, segs, states)
    }

    /// [`Self::delta_rule_chunked_fast`] with q, k, v and the output in bf16, as fla's chunked
    /// kernel takes them (half the bytes read and written at each end). Rows of bf16 values
    /// give the bits the f32 form gives for the same values, the output rounded to bf16 once
    /// (a device test checks both). Runs the default variant ([`FAST_VARIANT`]).
    pub fn delta_rule_chunked_fast_bf16(
        &self,
        heads: &DeltaRuleHeads,
        x: &GpuBf16DeltaRuleInputs,
        segs: &GpuSegments,
        states: GpuStates,
        out: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let what = "delta_rule_chunked_fast_bf16";
        check_operands(what, heads, [&x.q, &x.k, &x.v], [x.g, x.beta], out.len(), segs.tokens)?;
        let out = self.gpu.ptr(out);
        let operands = FastOperands::new(&self.gpu, [&x.q, &x.k, &x.v], [x.g, x.beta], x.normalize_qk, out);
        self.chunked_fast(what, heads, &operands, FastIo::Bf16, segs, states)
    }

    /// The two passes of the fast prefill over checked operands.
    fn chunked_fast(&self, what: &str, heads: &DeltaRuleHeads, x: &FastOperands, io: FastIo, segs: &GpuSegments, mut states: GpuStates) -> Result<()> {
        let (pool, state_table, state_ranges) = states.resolve(&self.gpu, &format!("{what} states"), segs, heads.state_len())?;
        let DeltaRuleHeads { n_k_heads, n_v_heads, d_k, d_v, key_head } = *heads;
        // The bf16 forms exist for the default variant only.
        let FastVariant { rows, stages, compact, late_issue, tiled, cluster, warpgroup, transposed, state_rows, segments } =
            if io == FastIo::Bf16 { FAST_VARIANT } else { self.fast_variant };
        // The warpgroup state pass is built for d_k 128 on sm_90; other head sizes and devices
        // take the mma.sync form (the same operands).
        let warpgroup = warpgroup && d_k == 128 && self.gpu.warpgroup_products();
        let transposed = transposed && warpgroup;
        // Blocks of more state rows where the warpgroup form runs and d_v holds them whole.
        let state_rows = if warpgroup && !transposed && d_v % state_rows == 0 { state_rows } else { TC_STATE_ROWS };
        let (prepare, state) = match io {
            FastIo::F32 => (
                self.tc_prepare.iter().find(|(d, _)| *d == (d_k, d_v, rows, compact, tiled)).map(|(_, f)| f),
                self.tc_state.iter().find(|(d, _)| *d == (d_k, stages, late_issue, cluster, warpgroup, transposed, state_rows)).map(|(_, f)| f),
            ),
            FastIo::Bf16 => (
                self.tc_prepare_bf16.iter().find(|(d, _)| *d == (d_k, d_v)).map(|(_, f)| f),
                self.tc_state_bf16.iter().find(|(d, _)| *d == (d_k, warpgroup, state_rows)).map(|(_, f)| f),
            ),
        };
        let (Some(prepare), Some(state)) = (prepare, state) else {
            return Err(Error::Shape(format!("{what} on CUDA: d_k {d_k}, d_v {d_v} (each must be one of {FAST_CHUNK_HEAD_DIMS:?})")));
        };
        let Some(table) = segs.chunk_table(&self.gpu)? else { return Ok(()) };
        if table.n_chunks > 65_535 {
            return Err(Error::Shape(format!("{what}: {} chunks, at most 65535 per launch", table.n_chunks)));
        }
        let bytes = fast_operand_regions(heads, table.n_chunks);
        // The state pass's blocks: (value head, state rows, sequence), times its segments.
        let rows_per_block = if transposed { 2 * TC_STATE_ROWS } else { state_rows };
        let slices = d_v / rows_per_block;
        let blocks = n_v_heads * slices * segs.n_seqs();
        let n_segments = if segments && warpgroup && !transposed && x.normalize_qk {
            let longest = segs.segments().iter().map(|s| s.len.div_ceil(CHUNK)).max().unwrap_or(0);
            let multiprocessors = if self.state_segments.is_some() { 0 } else { self.gpu.multiprocessors()? };
            state_segment_count(self.state_segments, multiprocessors, blocks, longest)
        } else {
            1
        };
        // Segments' words (tickets, flags) and final states (chunked_tc.cu), after the operands.
        let (ctl_len, boundary_len) = if n_segments > 1 {
            (1 + blocks * n_segments + blocks, segs.n_seqs() * n_segments * heads.state_len())
        } else {
            (0, 0)
        };
        let operand_bytes: usize = bytes.iter().sum();
        let scratch = self.scratch(operand_bytes / 4 + boundary_len + ctl_len)?;
        let stream = self.gpu.stream();
        let base = self.gpu.ptr(&*scratch);
        let mut at = [0u64; 6];
        for i in 1..6 {
            at[i] = at[i - 1] + bytes[i - 1] as u64;
        }
        let [w_s, u_s, qk_s, qn_s, kn_s, dec_s] = at.map(|o| base + o);
        let boundary = base + operand_bytes as u64;
        let ctl = if n_segments > 1 { boundary + 4 * boundary_len as u64 } else { 0 };
        let (nk, nv, dv) = (i32_of("key heads", n_k_heads)?, i32_of("value heads", n_v_heads)?, i32_of("d_v", d_v)?);
        let grouped = (key_head == KeyHeadMap::Grouped) as i32;
        let (chunk_t0, chunk_len) = (table.chunk_t0.device_ptr(stream).0, table.chunk_len.device_ptr(stream).0);

        let args = TcPrepArgs {
            q: x.q.0,
            q_stride: x.q.1,
            k: x.k.0,
            k_stride: x.k.1,
            v: x.v.0,
            v_stride: x.v.1,
            g: x.g,
            beta: x.beta,
            chunk_t0,
            chunk_len,
            w_s,
            u_s,
            qk_s,
            dec_s,
            qn_s,
            kn_s,
            ctl,
            nk,
            nv,
            grouped,
            l2qk: x.normalize_qk as i32,
            eps: L2_NORM_EPS,
            q_scale: (1.0 / (d_k as f64).sqrt()) as f32,
            ctl_len: i32_of("segment words", ctl_len)?,
        };
        // The heads of one chunk are neighbours in the grid, so q and k rows read by a key
        // head's second value head come from L2.
        let cfg = LaunchConfig {
            grid_dim: (n_v_heads as u32, table.n_chunks as u32, 1),
            block_dim: (CHUNK_THREADS, 1, 1),
            shared_mem_bytes: tc_prepare_smem(d_k, d_v, compact) as u32,
        };
        let mut l = self.gpu.launch_builder(prepare);
        l.arg(&args);
        // SAFETY: TcPrepArgs mirrors the kernel's struct; every pointer is a live buffer of the
        // length the shape checks established, and the scratch regions hold every chunk-head.
        unsafe { l.launch(cfg) }.map_err(launch_err("launching tern_gdn_tc_prepare"))?;
        if self.chunk_prepare_only {
            return Ok(());
        }

        let args = TcStateArgs {
            states: pool,
            out: x.out,
            w_s,
            u_s,
            qk_s,
            dec_s,
            qn_s,
            kn_s,
            seg_chunk0: table.seg_chunk0.device_ptr(stream).0,
            seg_nchunks: table.seg_nchunks.device_ptr(stream).0,
            chunk_t0,
            chunk_len,
            slot: segs.slot.device_ptr(stream).0,
            state_at: self.gpu.ptr_opt(state_table.as_deref()),
            boundary,
            ctl,
            nk,
            nv,
            dv,
            grouped,
            segments: n_segments as i32,
        };
        let slices = slices as u32;
        let cfg = LaunchConfig {
            grid_dim: (n_v_heads as u32, slices, (segs.n_seqs() * n_segments) as u32),
            block_dim: (if transposed { 128 } else { CHUNK_THREADS }, 1, 1),
            shared_mem_bytes: if transposed {
                tc_state_t_smem()
            } else if warpgroup {
                tc_state_wg_smem(rows_per_block)
            } else {
                tc_state_smem(d_k, stages, cluster)
            } as u32,
        };
        let mut l = self.gpu.launch_builder(state);
        l.arg(&args);
        if cluster && self.cluster_blocks > 1 {
            // Slices of one value head and sequence (2 of them where d_v is 64).
            l.cluster((1, (self.cluster_blocks as u32).min(slices), 1));
        }
        // SAFETY: as above; slots lie inside the state pool (checked).
        unsafe { l.launch(cfg) }.map_err(launch_err("launching tern_gdn_tc_state"))?;
        self.gpu.note_state_writer(state_ranges);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
