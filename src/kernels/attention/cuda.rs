//! Launchers of `attention.cu` (f32, CUDA cores) and `attention_tc.cu` (bf16 tensor cores,
//! fast mode), with the shape checks of the CPU twin in this folder.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYN_SMEM;
use cudarc::driver::DeviceRepr;

use crate::cuda::{driver_err, grid_for, int_arg, long_arg, CudaFunction, CudaSlice, Gpu, KernelLaunch, KernelSource, LaunchConfig};
use crate::error::{Error, Result};
use crate::kernels::attention::AttentionShape;
use crate::kernels::backend::{check_view, View};
use crate::kernels::norm::cuda::NormOut;
use crate::kernels::rope::cuda::GpuHeadPrep;
use crate::kernels::rope::{check_head_prep, HeadPrepView};
use crate::kernels::{check_len, Segment};

pub const SOURCE: KernelSource =
    KernelSource { name: "tern_attention", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("attention.cu")) };

pub const SOURCE_TC: KernelSource = KernelSource {
    name: "tern_attention_tc",
    code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("attention_tc.cu")),
};

/// Queries per block (TERN_ATT_BQ) and keys per tile (TERN_ATT_BK) of the kernel.
pub const QUERY_TILE: usize = 32;
const KEY_TILE: usize = 32;
/// The widest head: four 128-column chunks per lane.
pub const MAX_HEAD_DIM: usize = 512;

/// The tensor-core kernel's head sizes: hd is rounded up to the next (zero-padded columns).
const TC_HEAD_DIMS: [usize; 4] = [64, 128, 256, 512];
/// Its query tiles: 8 warps of 16 rows, pairs of warps per row group when hd is 512.
const TC_QUERY_TILES: [usize; 2] = [128, 64];
/// Its key tile (the kernels' BK: their names end in `_bk64`).
const TC_KEY_TILE: usize = 64;
/// Batches of at most this many rows (a short query) take the f32 kernel even in the fast
/// mode: one launch instead of two (the K/V packing and the tensor-core kernel) for a product
/// of at most one key tile per query tile.
const TC_MIN_ROWS: usize = 64;

fn tc_query_tile(padded_hd: usize) -> usize {
    if padded_hd > 256 {
        64
    } else {
        128
    }
}

fn tc_smem_bytes(padded_hd: usize) -> usize {
    // Q, K and V tiles of whole (swizzled) rows; the P tile's rows padded by 8.
    let (bq, bk, ld) = (tc_query_tile(padded_hd), TC_KEY_TILE, padded_hd);
    2 * (bq * ld + 2 * bk * ld + bq * (bk + 8)) + 4 * 8 * 16
}

/// One tile list: tile i covers queries q0[i] .. q0[i] + size of segment seg[i].
struct TileList {
    seg: CudaSlice<u32>,
    q0: CudaSlice<u32>,
    count: usize,
}

fn tile_list(gpu: &Gpu, segments: &[Segment], size: usize) -> Result<TileList> {
    let (mut seg, mut q0) = (Vec::new(), Vec::new());
    for (i, s) in segments.iter().enumerate() {
        for t in (0..s.len).step_by(size) {
            seg.push(i as u32);
            q0.push(t as u32);
        }
    }
    Ok(TileList { count: seg.len(), seg: gpu.upload(&seg)?, q0: gpu.upload(&q0)? })
}

/// The packed batch as the kernel walks it: the segments, and one entry per tile of
/// [`QUERY_TILE`] queries of one sequence.
pub struct GpuAttentionBatch {
    pub segments: Vec<Segment>,
    pub rows: usize,
    pub seg_start: CudaSlice<u32>,
    pub seg_len: CudaSlice<u32>,
    tile_seg: CudaSlice<u32>,
    tile_q0: CudaSlice<u32>,
    tiles: usize,
    /// The tensor-core kernel's tiles, one list per entry of TC_QUERY_TILES.
    tc_tiles: [TileList; 2],
    /// Each row's segment, when every segment is at most [`SHORT_MAX`] rows and one is longer
    /// than a row (the short kernel). A decode step (every sequence one row) never runs this
    /// attention (it reads the KV caches), so its batch, made every step, uploads no list.
    row_seg: Option<CudaSlice<u32>>,
}

/// Sequences up to this many rows take the short kernel (`tern_attention_short_hd*`: key j's
/// score is lane j's).
const SHORT_MAX: usize = 32;

impl GpuAttentionBatch {
    pub fn new(gpu: &Gpu, segments: &[Segment]) -> Result<Self> {
        let rows = segments.last().map_or(0, |s| s.start + s.len);
        let (mut tile_seg, mut tile_q0) = (Vec::new(), Vec::new());
        let mut expect = 0;
        for (i, s) in segments.iter().enumerate() {
            if s.start != expect || s.len == 0 {
                return Err(Error::Shape(format!("attention batch: segment {i} ({s:?}) is empty or not packed end to end")));
            }
            expect = s.start + s.len;
            for q0 in (0..s.len).step_by(QUERY_TILE) {
                tile_seg.push(i as u32);
                tile_q0.push(q0 as u32);
            }
        }
        u32::try_from(rows).map_err(|_| Error::Shape(format!("attention batch: {rows} rows exceed 32-bit indexing")))?;
        let start: Vec<u32> = segments.iter().map(|s| s.start as u32).collect();
        let len: Vec<u32> = segments.iter().map(|s| s.len as u32).collect();
        Ok(GpuAttentionBatch {
            segments: segments.to_vec(),
            rows,
            seg_start: gpu.upload(&start)?,
            seg_len: gpu.upload(&len)?,
            tiles: tile_seg.len(),
            tile_seg: gpu.upload(&tile_seg)?,
            tile_q0: gpu.upload(&tile_q0)?,
            tc_tiles: [tile_list(gpu, segments, TC_QUERY_TILES[0])?, tile_list(gpu, segments, TC_QUERY_TILES[1])?],
            row_seg: if segments.iter().all(|s| s.len <= SHORT_MAX) && segments.iter().any(|s| s.len > 1) {
                let seg: Vec<u32> = segments.iter().enumerate().flat_map(|(i, s)| std::iter::repeat_n(i as u32, s.len)).collect();
                Some(gpu.upload(&seg)?)
            } else {
                None
            },
        })
    }
}

pub struct AttentionCuda {
    gpu: Arc<Gpu>,
    /// Kernels for heads of up to 128, 256 and 512 channels.
    kernels: [(usize, CudaFunction); 3],
    /// The short-sequence kernels, by head size as `kernels`.
    short_kernels: [(usize, CudaFunction); 3],
    /// bf16 tensor-core kernels, by padded head size.
    tc_kernels: [(usize, CudaFunction); 4],
    /// Their K and V operands: bf16, packed, padded heads (`tern_attention_tc_pack_kv`).
    tc_pack_kv: CudaFunction,
}

fn smem_bytes(hd: usize) -> usize {
    4 * (QUERY_TILE * (hd + 4) + KEY_TILE * (hd + 4) + KEY_TILE * hd + QUERY_TILE * (KEY_TILE + 1) + 8 * KEY_TILE * 4)
}

impl AttentionCuda {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        let load = |chunks: usize| -> Result<(usize, CudaFunction)> {
            let f = gpu.function(&SOURCE, &format!("tern_attention_hd{chunks}"))?;
            let bytes = smem_bytes(128 * chunks) as i32;
            f.set_attribute(MAX_DYN_SMEM, bytes).map_err(driver_err("allowing the attention kernel's shared memory"))?;
            Ok((128 * chunks, f))
        };
        let kernels = [load(1)?, load(2)?, load(4)?];
        let short = |chunks: usize| -> Result<(usize, CudaFunction)> { Ok((128 * chunks, gpu.function(&SOURCE, &format!("tern_attention_short_hd{chunks}"))?)) };
        let short_kernels = [short(1)?, short(2)?, short(4)?];
        let load_tc = |hd: usize| -> Result<(usize, CudaFunction)> {
            let f = gpu.function(&SOURCE_TC, &format!("tern_attention_tc_hd{hd}_bk{TC_KEY_TILE}"))?;
            f.set_attribute(MAX_DYN_SMEM, tc_smem_bytes(hd) as i32)
                .map_err(driver_err("allowing the tensor-core attention kernel's shared memory"))?;
            Ok((hd, f))
        };
        let tc_kernels = [load_tc(TC_HEAD_DIMS[0])?, load_tc(TC_HEAD_DIMS[1])?, load_tc(TC_HEAD_DIMS[2])?, load_tc(TC_HEAD_DIMS[3])?];
        let tc_pack_kv = gpu.function(&SOURCE_TC, "tern_attention_tc_pack_kv")?;
        Ok(AttentionCuda { gpu, kernels, short_kernels, tc_kernels, tc_pack_kv })
    }

    /// out[t] = softmax(scale · q_h(t)·K_gᵀ)·V_g within each sequence, over the keys with
    /// |i − j| ≤ max_distance. q, k, v are views with rows of q_heads·hd and kv_heads·hd;
    /// out is contiguous [rows][q_heads·hd]. CPU twin: [`super::attention`].
    pub fn attention(
        &self,
        q: View<CudaSlice<f32>>,
        k: View<CudaSlice<f32>>,
        v: View<CudaSlice<f32>>,
        batch: &GpuAttentionBatch,
        shape: &AttentionShape,
        out: NormOut,
    ) -> Result<()> {
        let window = check_args(&q, &k, &v, batch, shape, &out)?;
        self.run(Operands { q, k, v, batch, shape, out, window }, false)
    }

    /// The fast-mode form of [`Self::attention`], same operands and checks: Q, K, V rounded to
    /// bf16 (K and V once, into packed copies), S = Q·Kᵀ and P·V on tensor cores with f32 accumulation, the online
    /// softmax in f32, P rounded to bf16; f32 output (+ optional bf16 copy). Head sizes are
    /// padded with zero columns to 64, 128, 256 or 512. A batch of at most [`TC_MIN_ROWS`]
    /// rows runs an f32 kernel instead (the short one when its sequences are short).
    pub fn attention_bf16(
        &self,
        q: View<CudaSlice<f32>>,
        k: View<CudaSlice<f32>>,
        v: View<CudaSlice<f32>>,
        batch: &GpuAttentionBatch,
        shape: &AttentionShape,
        out: NormOut,
    ) -> Result<()> {
        let window = check_args(&q, &k, &v, batch, shape, &out)?;
        self.run(Operands { q, k, v, batch, shape, out, window }, true)
    }

    /// Causal attention within each sequence (query i sees keys 0 ..= i of its own sequence):
    /// a prompt run from an empty KV cache, on the kernels of [`Self::attention`] and
    /// [`Self::attention_bf16`] (`tensor_cores`). `shape.max_distance` must be None. CPU twin:
    /// [`super::causal_attention`] with no past.
    #[allow(clippy::too_many_arguments)]
    pub fn causal(
        &self,
        q: View<CudaSlice<f32>>,
        k: View<CudaSlice<f32>>,
        v: View<CudaSlice<f32>>,
        batch: &GpuAttentionBatch,
        shape: &AttentionShape,
        out: NormOut,
        tensor_cores: bool,
    ) -> Result<()> {
        if shape.max_distance.is_some() {
            return Err(Error::Shape("causal attention takes no window".into()));
        }
        check_args(&q, &k, &v, batch, shape, &out)?;
        self.run(Operands { q, k, v, batch, shape, out, window: CAUSAL_WINDOW }, tensor_cores)
    }

    /// The tensor-core kernel for a fast-mode batch of more than [`TC_MIN_ROWS`] rows (as
    /// measured before the short kernel existed: a batch of many short texts in fast mode keeps
    /// it), else the short kernel when every sequence is short, else the f32 flash kernel over
    /// the batch's tiles; with the window argument the kernels take. The operands passed
    /// [`check_args`].
    fn run(&self, a: Operands, tensor_cores: bool) -> Result<()> {
        let (batch, shape) = (a.batch, a.shape);
        let tc = tensor_cores && batch.rows > TC_MIN_ROWS;
        if let (false, Some(row_seg)) = (tc, &batch.row_seg) {
            return self.launch_short(row_seg, a);
        }
        if tc {
            let (padded, f) = self.tc_kernels.iter().find(|(max, _)| shape.hd <= *max).expect("hd <= MAX_HEAD_DIM was checked");
            let list = &batch.tc_tiles[TC_QUERY_TILES.iter().position(|&t| t == tc_query_tile(*padded)).expect("a tile list per tile size")];
            if list.count == 0 {
                return Ok(());
            }
            let tiles = Tiles { seg: &list.seg, q0: &list.q0, count: list.count };
            self.launch_tc(f, *padded, tiles, a)
        } else {
            if batch.tiles == 0 {
                return Ok(());
            }
            let (_, f) = self.kernels.iter().find(|(max, _)| shape.hd <= *max).expect("hd <= MAX_HEAD_DIM was checked");
            let tiles = Tiles { seg: &batch.tile_seg, q0: &batch.tile_q0, count: batch.tiles };
            // SAFETY: tern_attention_hd* takes the arguments `launch` passes.
            unsafe { self.launch(f, tiles, smem_bytes(shape.hd), "launching tern_attention", a) }
        }
    }

    /// # Safety
    /// `f` takes (q, q_off, q_ld, k.., v.., out, out_ld, out16, seg_start, seg_len, tile_seg,
    /// tile_q0, group, hd, scale, max_distance), runs 256 threads, walks tiles of the size
    /// `tiles` was built for, and needs `smem` bytes; the arguments passed [`check_args`].
    unsafe fn launch(&self, f: &CudaFunction, tiles: Tiles, smem: usize, what: &'static str, a: Operands) -> Result<()> {
        let AttentionShape { q_heads, kv_heads, hd, scale, .. } = *a.shape;
        let g = &self.gpu;
        let lead = LeadArgs::new(g, &a);
        let (group, hd_i, window) = (int_arg("attention group", q_heads / kv_heads)?, int_arg("head size", hd)?, a.window);
        let (ts, tq) = (g.ptr(tiles.seg), g.ptr(tiles.q0));
        let mut l = g.launch_builder(f);
        lead.push(&mut l);
        l.arg(&ts).arg(&tq).arg(&group).arg(&hd_i).arg(&scale).arg(&window);
        let cfg = tiles.grid(q_heads, smem)?;
        // SAFETY: argument types match (the caller's contract); every view holds the rows of
        // the batch (checked), offsets and strides are 16-byte multiples, tiles index the segments.
        unsafe { l.launch(cfg) }.map_err(driver_err(what))?;
        Ok(())
    }
}

impl AttentionCuda {
    /// The short-sequence kernel (every segment at most [`SHORT_MAX`] rows, `row_seg` each
    /// row's segment): one warp per (row, query head), in f32 (a short sequence's attention is a
    /// few multiply-adds per row, and a 128-query tensor-core tile would be mostly empty). The
    /// operands passed [`check_args`].
    fn launch_short(&self, row_seg: &CudaSlice<u32>, a: Operands) -> Result<()> {
        let AttentionShape { q_heads, kv_heads, hd, scale, .. } = *a.shape;
        let (g, batch, window) = (&self.gpu, a.batch, a.window);
        let (_, f) = self.short_kernels.iter().find(|(max, _)| hd <= *max).expect("hd <= MAX_HEAD_DIM was checked");
        let lead = LeadArgs::new(g, &a);
        let rs = g.ptr(row_seg);
        let tasks = batch.rows * q_heads;
        int_arg("attention rows x heads", tasks)?; // the kernel's task index
        let (rows, heads) = (int_arg("attention rows", batch.rows)?, int_arg("query heads", q_heads)?);
        let (group, hd_i) = (int_arg("attention group", q_heads / kv_heads)?, int_arg("head size", hd)?);
        let mut l = g.launch_builder(f);
        lead.push(&mut l);
        l.arg(&rs).arg(&rows).arg(&heads).arg(&group).arg(&hd_i).arg(&scale).arg(&window);
        let cfg = LaunchConfig { grid_dim: (grid_for(tasks, 8)?, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match tern_attention_short_hd*; every view holds the batch's
        // rows (checked), offsets and strides are 16-byte multiples, row_seg holds a segment
        // index per row, every segment is at most 32 rows (the kernel's one key per lane).
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_attention_short"))?;
        Ok(())
    }

    /// The tensor-core kernel `f` for heads padded to `padded` columns: K and V packed into
    /// bf16 copies [rows][kv_heads][padded], then the tiles. The operands passed [`check_args`].
    #[allow(clippy::too_many_arguments)]
    fn launch_tc(&self, f: &CudaFunction, padded: usize, tiles: Tiles, a: Operands) -> Result<()> {
        let AttentionShape { q_heads, kv_heads, hd, scale, .. } = *a.shape;
        let Operands { q, k, v, batch, out, window, .. } = a;
        let g = &self.gpu;
        let packed = batch.rows * kv_heads * padded;
        // Freed when this returns; the stream orders the free after the kernels that read them.
        let (kb, vb) = (g.alloc::<u16>(packed)?, g.alloc::<u16>(packed)?);
        let (kp, vp, kbp, vbp) = (g.ptr(k.buf), g.ptr(v.buf), g.ptr(&kb), g.ptr(&vb));
        let (ko, kl, vo, vl) = (long_arg(k.offset), long_arg(k.stride), long_arg(v.offset), long_arg(v.stride));
        let (rows, kvh, hd_i, hdp) = (int_arg("attention rows", batch.rows)?, int_arg("kv heads", kv_heads)?, int_arg("head size", hd)?, int_arg("padded head size", padded)?);
        let mut l = g.launch_builder(&self.tc_pack_kv);
        l.arg(&kp).arg(&ko).arg(&kl).arg(&vp).arg(&vo).arg(&vl).arg(&rows).arg(&kvh).arg(&hd_i).arg(&hdp).arg(&kbp).arg(&vbp);
        let groups = packed / 4;
        let cfg = LaunchConfig { grid_dim: (grid_for(groups.max(1), 256)?.min(65_535), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match tern_attention_tc_pack_kv; the views hold rows of
        // kv_heads · hd (checked), kb and vb rows · kv_heads · padded values, padded % 4 == 0.
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_attention_tc_pack_kv"))?;

        let (qp, op, o16p) = (g.ptr(q.buf), g.ptr_opt(out.f32.as_deref()), g.ptr_opt(out.bf16.as_deref()));
        let (qo, ql, out_ld) = (long_arg(q.offset), long_arg(q.stride), long_arg(q_heads * hd));
        let group = int_arg("attention group", q_heads / kv_heads)?;
        let (ss, sl, ts, tq) = (g.ptr(&batch.seg_start), g.ptr(&batch.seg_len), g.ptr(tiles.seg), g.ptr(tiles.q0));
        let mut l = g.launch_builder(f);
        l.arg(&qp).arg(&qo).arg(&ql).arg(&kbp).arg(&vbp).arg(&kvh);
        l.arg(&op).arg(&out_ld).arg(&o16p).arg(&ss).arg(&sl).arg(&ts).arg(&tq).arg(&group).arg(&hd_i).arg(&scale).arg(&window);
        let cfg = tiles.grid(q_heads, tc_smem_bytes(padded))?;
        // SAFETY: argument types match tern_attention_tc_hd{padded}_bk*; q holds the batch's rows
        // (checked, 16-byte offsets and strides), kb and vb the packed rows; the tiles are
        // tc_query_tile(padded) queries and index the segments.
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_attention_tc"))?;
        Ok(())
    }
}

impl Tiles<'_> {
    /// One block of 256 threads per (tile, query head), with `smem` bytes of shared memory.
    fn grid(&self, q_heads: usize, smem: usize) -> Result<LaunchConfig> {
        let count = u32::try_from(self.count).map_err(|_| Error::Shape("attention: too many query tiles".into()))?;
        let heads = u32::try_from(q_heads).ok().filter(|&h| h <= 65_535).ok_or_else(|| Error::Shape(format!("attention: {q_heads} heads")))?;
        Ok(LaunchConfig { grid_dim: (count, heads, 1), block_dim: (256, 1, 1), shared_mem_bytes: smem as u32 })
    }
}

/// A call's operands, as the launchers take them: q, k and v, the batch and shape, the outputs
/// and the kernels' window argument (from [`check_args`], or [`CAUSAL_WINDOW`]); they passed
/// [`check_args`].
struct Operands<'a> {
    q: View<'a, CudaSlice<f32>>,
    k: View<'a, CudaSlice<f32>>,
    v: View<'a, CudaSlice<f32>>,
    batch: &'a GpuAttentionBatch,
    shape: &'a AttentionShape,
    out: NormOut<'a>,
    window: i32,
}

/// The arguments the f32 kernels (flash and short) take first, in their order: q, k and v
/// (address, offset and row stride each), the f32 output, its row stride (q_heads · hd), the
/// bf16 output (0: none), and the segments' starts and lengths.
struct LeadArgs {
    qkv: [(u64, i64, i64); 3],
    out: u64,
    out_ld: i64,
    out16: u64,
    seg_start: u64,
    seg_len: u64,
}

impl LeadArgs {
    fn new(g: &Gpu, a: &Operands) -> Self {
        let view = |x: &View<CudaSlice<f32>>| (g.ptr(x.buf), long_arg(x.offset), long_arg(x.stride));
        LeadArgs {
            qkv: [view(&a.q), view(&a.k), view(&a.v)],
            out: g.ptr_opt(a.out.f32.as_deref()),
            out_ld: long_arg(a.shape.q_heads * a.shape.hd),
            out16: g.ptr_opt(a.out.bf16.as_deref()),
            seg_start: g.ptr(&a.batch.seg_start),
            seg_len: g.ptr(&a.batch.seg_len),
        }
    }

    fn push<'a>(&'a self, l: &mut KernelLaunch<'a>) {
        for (address, offset, stride) in &self.qkv {
            l.arg(address).arg(offset).arg(stride);
        }
        l.arg(&self.out).arg(&self.out_ld).arg(&self.out16).arg(&self.seg_start).arg(&self.seg_len);
    }
}

/// A tile list as a launch reads it.
struct Tiles<'a> {
    seg: &'a CudaSlice<u32>,
    q0: &'a CudaSlice<u32>,
    count: usize,
}

/// The kernels' window argument for causal attention (TERN_ATT_CAUSAL in prelude.cuh).
const CAUSAL_WINDOW: i32 = -2;

/// The checks both kernels need; returns the window as the kernels take it (-1: none).
fn check_args(
    q: &View<CudaSlice<f32>>,
    k: &View<CudaSlice<f32>>,
    v: &View<CudaSlice<f32>>,
    batch: &GpuAttentionBatch,
    shape: &AttentionShape,
    out: &NormOut,
) -> Result<i32> {
    let AttentionShape { q_heads, kv_heads, hd, max_distance, .. } = *shape;
    if kv_heads == 0 || q_heads % kv_heads != 0 {
        return Err(Error::Shape(format!("attention: {q_heads} query heads over {kv_heads} kv heads")));
    }
    if hd == 0 || hd % 4 != 0 || hd > MAX_HEAD_DIM {
        return Err(Error::Cuda(format!("attention: head size {hd} is not supported on CUDA (multiples of 4 up to {MAX_HEAD_DIM})")));
    }
    let rows = batch.rows;
    check_view("attention q", q.buf.len(), q.offset, q.stride, rows, q_heads * hd)?;
    check_view("attention k", k.buf.len(), k.offset, k.stride, rows, kv_heads * hd)?;
    check_view("attention v", v.buf.len(), v.offset, v.stride, rows, kv_heads * hd)?;
    for (what, view) in [("q", q), ("k", k), ("v", v)] {
        if view.offset % 4 != 0 || view.stride % 4 != 0 {
            return Err(Error::Shape(format!("attention {what}: offset and stride must be multiples of 4 floats")));
        }
    }
    if let Some(o) = &out.f32 {
        check_len("attention out", o.len(), rows * q_heads * hd)?;
    }
    if let Some(o) = &out.bf16 {
        check_len("attention out", o.len(), rows * q_heads * hd)?;
    }
    let longest = batch.segments.iter().map(|s| s.len).max().unwrap_or(0);
    // A window at least as long as the sequence is no window (and keeps the int small).
    Ok(match max_distance {
        Some(w) if w < longest => w as i32,
        _ => -1,
    })
}

pub const SOURCE_KV: KernelSource =
    KernelSource { name: "tern_attention_kv", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("../rope/head.cuh"), "\n", include_str!("kv.cu")) };

/// One sequence's KV cache of one layer on the device: `width` keys and values per row, in
/// buffers of `capacity` rows that grow by doubling (a copy) when a step needs more. The
/// kernels take the filled rows from the batch's positions on the device, so that a recorded
/// decode step needs no host-side bookkeeping. `rows` is the host's count for the checks: the
/// rows the cache held when the current step reserved it ([`GpuKv::reserve`], which every step
/// calls before it runs, replayed steps included). Nothing inside a step changes it, so a step
/// run once plainly and once more to be recorded sees the same count both times.
pub struct GpuKv {
    pub keys: CudaSlice<f32>,
    pub values: CudaSlice<f32>,
    pub rows: usize,
    pub capacity: usize,
    pub width: usize,
}

/// Rows a fresh cache holds before its first growth.
const KV_FIRST_CAPACITY: usize = 256;

impl GpuKv {
    pub fn new(gpu: &Gpu, width: usize) -> Result<Self> {
        Ok(GpuKv { keys: gpu.alloc(KV_FIRST_CAPACITY * width)?, values: gpu.alloc(KV_FIRST_CAPACITY * width)?, rows: 0, capacity: KV_FIRST_CAPACITY, width })
    }

    /// Makes room for `need` rows, keeping the first `filled` (which the cache now holds).
    pub fn reserve(&mut self, gpu: &Gpu, filled: usize, need: usize) -> Result<()> {
        self.rows = filled;
        if need <= self.capacity {
            return Ok(());
        }
        let capacity = need.max(2 * self.capacity);
        for buf in [&mut self.keys, &mut self.values] {
            let mut grown = gpu.alloc::<f32>(capacity * self.width)?;
            gpu.copy_range(buf, 0, &mut grown, 0, filled.min(self.capacity) * self.width)?;
            *buf = grown;
        }
        self.capacity = capacity;
        Ok(())
    }

    /// The buffers' identity (a recorded step that writes this cache is valid while it holds).
    pub fn handle(&self, gpu: &Gpu) -> [u64; 3] {
        [gpu.ptr(&self.keys), gpu.ptr(&self.values), self.capacity as u64]
    }
}

/// Each row's cache on the device: the addresses of its sequence's keys and values.
struct RowTables {
    k_at: Arc<CudaSlice<u64>>,
    v_at: Arc<CudaSlice<u64>>,
}

/// Decode attention that prepares its q and k heads itself ([`KvAttentionCuda::kv_attention`]'s
/// `prep`: PREP in kv.cu), as [`crate::kernels::rope::cuda::RopeCuda::head_prep`] would in place
/// before it.
pub struct KvHeadPrep<'a> {
    pub q: GpuHeadPrep<'a>,
    pub k: GpuHeadPrep<'a>,
    /// The batch's largest position (the rotation tables must hold it).
    pub max_position: usize,
}

/// Mirrors `tern_kv_prep` in kv.cu field for field (C layout), passed by value; `on` 0 (the
/// default): the heads arrive prepared.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct KvPrepArgs {
    w: [u64; 2],
    cos: [u64; 2],
    sin: [u64; 2],
    norm: [i32; 2],
    rot: [i32; 2],
    eps: [f32; 2],
    on: i32,
}
// SAFETY: plain integers and floats in the kernel's C layout.
unsafe impl DeviceRepr for KvPrepArgs {}

/// Launchers of `kv.cu`.
pub struct KvAttentionCuda {
    gpu: Arc<Gpu>,
    append: CudaFunction,
    /// tern_kv_attention_p{PER} for each of [`KV_LANE_VALUES`], with [`KV_WARPS`] warps a block.
    attend: Vec<CudaFunction>,
    /// The same with 16 warps a block (tern_kv_attention_p{PER}_w16).
    attend_w16: Vec<CudaFunction>,
    gate: CudaFunction,
    form: KvForm,
    /// Whether a row of few keys takes fewer splits than `form` (as many as give each split a
    /// round of keys a warp; `min_keys` in kv.cu), on unless TERN_KV_SHORT_SPLITS=0 (to measure
    /// the two on the same run). H100, Qwen3.5-0.8B bf16 decode from a 16-token prompt, same
    /// call: 950.0 / 951.0 tok/s against 932.1 / 933.6 (+1.9%); after 512 tokens level
    /// (BENCHMARKS.md, twenty-first session).
    short_splits: bool,
    /// The heads' arrival counters of [`KV_KEPT_COUNTERS`] (row, head) pairs, zeroed once here
    /// and left zero by every launch (the last block of a head resets its counter), so a
    /// recorded decode step's attention follows the kernel before it with no memset between
    /// them: a memset node before a kernel is a full edge in the graph and takes away its
    /// dependent launch. Launches are ordered on the one stream, and a kernel touches the
    /// counters only after its wait for the kernel before it, so no two launches share them at
    /// once. None with TERN_KV_KEPT_COUNTERS=0 (every launch zeroes its own, to measure the two).
    kept_counters: Option<CudaSlice<u32>>,
}

/// (row, head) pairs whose arrival counters [`KvAttentionCuda`] keeps between launches (256 KB):
/// 128 sequences of 512 heads, or a prompt's rows past that zero counters of their own.
const KV_KEPT_COUNTERS: usize = 1 << 16;

/// How decode attention (tern_kv_attention) spreads a row's keys: over `splits` key ranges
/// (blocks) of `warps` warps each. [`KV_SPLITS`] ranges, of [`KV_WARPS_WIDE`] warps in a
/// process that decodes one sequence at a time, of [`KV_WARPS`] in one that decodes rounds of
/// many ([`prefer_batched_decode`]: the server); TERN_KV_SPLITS=16 takes 16 ranges,
/// TERN_KV_WARPS=4 or 16 that many warps. Other forms, other partial sums: all agree with the
/// CPU to f32 rounding. One form a process, so a sequence gets the same bits alone and in any
/// batch of that process.
///
/// Timed on an H100 (2026-12-05, random-weight Qwen3.5-0.8B, bf16 mode, tok/s): one sequence
/// after a 4096-token prompt, 8 ranges of 4 warps 683.0, of 16 warps 814.8, 16 ranges of 16
/// warps 841.0 (from an empty context all within 1%); rounds of 8 / 32 / 128 sequences, 4 warps
/// 5 732 / 12 953 / 26 077, 16 warps 5 454 / 11 499 / 21 051, 16 ranges of 16 warps 5 165 /
/// 10 240 / 16 820. A few blocks of many warps keep more keys in flight where one sequence's
/// blocks cannot fill the machine; many sequences fill it with blocks of 4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvForm {
    pub splits: usize,
    pub warps: usize,
}

impl KvForm {
    /// The form decode attention takes unless asked otherwise.
    pub const DEFAULT: KvForm = KvForm { splits: KV_SPLITS, warps: KV_WARPS_WIDE };

    /// Every form the kernels are built for.
    pub const ALL: [KvForm; 4] = [
        KvForm { splits: KV_SPLITS, warps: KV_WARPS },
        KvForm { splits: KV_MAX_SPLITS, warps: KV_WARPS },
        KvForm { splits: KV_SPLITS, warps: KV_WARPS_WIDE },
        KvForm { splits: KV_MAX_SPLITS, warps: KV_WARPS_WIDE },
    ];

    /// The form of a process that decodes rounds of many sequences.
    pub const BATCHED: KvForm = KvForm { splits: KV_SPLITS, warps: KV_WARPS };

    /// This process's form ([`KvForm::DEFAULT`], or [`KvForm::BATCHED`] after
    /// [`prefer_batched_decode`]), or what TERN_KV_SPLITS=16 / TERN_KV_WARPS=4|16 ask.
    pub fn from_env() -> KvForm {
        let var = |name| std::env::var(name).ok();
        Self::chosen(BATCHED_DECODE.load(Ordering::Relaxed), var("TERN_KV_SPLITS").as_deref(), var("TERN_KV_WARPS").as_deref())
    }

    /// The form for a process that decodes in rounds (`batched`) or not, with the switches'
    /// values.
    fn chosen(batched: bool, splits: Option<&str>, warps: Option<&str>) -> KvForm {
        let base = if batched { KvForm::BATCHED } else { KvForm::DEFAULT };
        KvForm {
            splits: if splits == Some("16") { KV_MAX_SPLITS } else { base.splits },
            warps: match warps {
                Some("4") => KV_WARPS,
                Some("16") => KV_WARPS_WIDE,
                _ => base.warps,
            },
        }
    }
}

/// Whether this process decodes rounds of many sequences (see [`KvForm`]).
static BATCHED_DECODE: AtomicBool = AtomicBool::new(false);

/// Tells decode attention that this process decodes rounds of many sequences (a server), so
/// that models loaded after this call take [`KvForm::BATCHED`].
pub fn prefer_batched_decode(on: bool) {
    BATCHED_DECODE.store(on, Ordering::Relaxed);
}

/// Values of a head row each lane of tern_kv_attention holds, one kernel each: heads of up to
/// 64, 128, 256 and 512 values (the launch takes the smallest that holds the head).
const KV_LANE_VALUES: [usize; 4] = [2, 4, 8, 16];
/// The most splits tern_kv_attention merges (TERN_KV_MAX_SPLITS in kv.cu).
const KV_MAX_SPLITS: usize = 16;

/// Warps per block of tern_kv_attention (TERN_KV_WARPS in kv.cu; TERN_KV_WARPS=4 at run time).
const KV_WARPS: usize = 4;
/// Warps per block of tern_kv_attention_p{PER}_w16 (the default).
const KV_WARPS_WIDE: usize = 16;
/// Key ranges each (row, head) of tern_kv_attention is split into. A constant, so that a row's
/// ranges — and so its bits — depend on its own keys only, never on the other sequences of its
/// batch or on their caches (a sequence decodes the same alone and in a server's batch); and
/// the launch shape of a recorded step does not depend on the positions. TERN_KV_SPLITS=16
/// doubles them (timed in [`KvForm`]'s note): a decode step of one sequence of Qwen3.5-0.8B (8 query
/// heads) is then 128 blocks, about one per multiprocessor, each walking half the keys.
const KV_SPLITS: usize = 8;
const _: () = assert!(KV_SPLITS <= KV_MAX_SPLITS);
/// The most floats of split partials one launch keeps (144 MiB: a decode step of 512
/// sequences of up to 17 query heads of 256): a step of more rows (a long prompt continued
/// after earlier turns, which runs alone) takes one split.
const KV_PARTIAL_FLOATS: usize = 36 << 20;

/// Splits of tern_kv_attention for `rows` query rows: `splits` (the launcher's), or one where
/// their partials would pass [`KV_PARTIAL_FLOATS`].
fn kv_splits(rows: usize, q_heads: usize, hd: usize, splits: usize) -> usize {
    if rows * q_heads * splits * (hd + 2) <= KV_PARTIAL_FLOATS {
        splits
    } else {
        1
    }
}

impl KvAttentionCuda {
    /// The launchers, with decode attention in `form` (one of [`KvForm::ALL`]).
    pub fn new(gpu: Arc<Gpu>, form: KvForm) -> Result<Self> {
        if !KvForm::ALL.contains(&form) {
            return Err(Error::Input(format!("decode attention form {form:?}: expected one of {:?}", KvForm::ALL)));
        }
        Ok(KvAttentionCuda {
            append: gpu.function(&SOURCE_KV, "tern_kv_append")?,
            attend: KV_LANE_VALUES.iter().map(|per| gpu.function(&SOURCE_KV, &format!("tern_kv_attention_p{per}"))).collect::<Result<_>>()?,
            attend_w16: KV_LANE_VALUES.iter().map(|per| gpu.function(&SOURCE_KV, &format!("tern_kv_attention_p{per}_w16"))).collect::<Result<_>>()?,
            gate: gpu.function(&SOURCE_KV, "tern_sigmoid_gate")?,
            form,
            short_splits: std::env::var("TERN_KV_SHORT_SPLITS").map_or(true, |v| v != "0"),
            kept_counters: match std::env::var("TERN_KV_KEPT_COUNTERS").map_or(true, |v| v != "0") {
                true => Some(gpu.zeros::<u32>(KV_KEPT_COUNTERS)?),
                false => None,
            },
            gpu,
        })
    }

    /// A prompt from empty caches: each sequence's k, v rows appended to its cache, causal
    /// attention on `attention`'s kernels ([`AttentionCuda::causal`]), then × sigmoid(gate).
    /// The same results as [`Self::kv_attention`] with every past 0, to f32 rounding (f32 kernel)
    /// or bf16 operand rounding (`tensor_cores`).
    #[allow(clippy::too_many_arguments)]
    pub fn prefill(
        &self,
        flash: &AttentionCuda,
        q: View<CudaSlice<f32>>,
        k: View<CudaSlice<f32>>,
        v: View<CudaSlice<f32>>,
        gate: View<CudaSlice<f32>>,
        batch: &GpuAttentionBatch,
        positions: &CudaSlice<u32>,
        caches: &mut [&mut GpuKv],
        shape: &AttentionShape,
        out: &mut CudaSlice<f32>,
        tensor_cores: bool,
    ) -> Result<()> {
        let (qw, kw) = (shape.q_heads * shape.hd, shape.kv_heads * shape.hd);
        check_view("kv prefill gate", gate.buf.len(), gate.offset, gate.stride, batch.rows, qw)?;
        check_view("kv prefill k", k.buf.len(), k.offset, k.stride, batch.rows, kw)?;
        check_view("kv prefill v", v.buf.len(), v.offset, v.stride, batch.rows, kw)?;
        if caches.len() != batch.segments.len() {
            return Err(Error::Shape(format!("kv prefill: {} caches for {} sequences", caches.len(), batch.segments.len())));
        }
        if let Some(c) = caches.iter().find(|c| c.rows != 0 || c.width != kw) {
            return Err(Error::Shape(format!("kv prefill: a cache of {} rows of {} (empty, rows of {kw} expected)", c.rows, c.width)));
        }
        check_len("kv prefill positions", positions.len(), batch.rows)?;
        flash.causal(q, k, v, batch, shape, NormOut { f32: Some(&mut *out), bf16: None }, tensor_cores)?;
        for (seg, cache) in batch.segments.iter().zip(caches.iter_mut()) {
            cache.reserve(&self.gpu, 0, seg.len)?;
        }
        let tables = self.row_tables(&batch.segments, caches, batch.rows)?;
        self.append_rows(&k, &v, batch.rows, kw, positions, &tables)?;
        let g = &self.gpu;
        let (n, w) = (int_arg("gate rows", batch.rows)?, int_arg("gate width", qw)?);
        let (op, gp, g_off, g_ld) = (g.ptr(out), g.ptr(gate.buf), long_arg(gate.offset), long_arg(gate.stride));
        let mut l = g.launch_builder(&self.gate);
        l.arg(&op).arg(&gp).arg(&g_off).arg(&g_ld).arg(&n).arg(&w);
        let blocks = crate::cuda::grid_for(batch.rows * qw, 256)?.min(65_535);
        // SAFETY: argument types match tern_sigmoid_gate; out holds rows × qw (checked by the
        // attention launch) and the gate view its rows (checked above).
        unsafe { l.launch(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }) }
            .map_err(driver_err("launching tern_sigmoid_gate"))?;
        Ok(())
    }

    /// Device tables of each row's cache addresses, keys and values: row r of segment s
    /// belongs to `caches[s]`.
    fn row_tables(&self, segments: &[Segment], caches: &[&mut GpuKv], rows: usize) -> Result<RowTables> {
        let g = &self.gpu;
        let (mut k_at, mut v_at) = (vec![0u64; rows], vec![0u64; rows]);
        for (seg, cache) in segments.iter().zip(caches) {
            let span = seg.start..seg.start + seg.len;
            if span.end > rows {
                return Err(Error::Shape(format!("kv attention: a segment ends at row {} of {rows}", span.end)));
            }
            k_at[span.clone()].fill(g.ptr(&cache.keys));
            v_at[span].fill(g.ptr(&cache.values));
        }
        // Every row has a cache: a row left out would make the kernels write through address 0.
        if k_at.contains(&0) {
            return Err(Error::Shape("kv attention: a row of the batch belongs to no sequence".into()));
        }
        Ok(RowTables { k_at: g.address_table(&k_at)?, v_at: g.address_table(&v_at)? })
    }

    /// Writes the `rows` rows of the k, v views into their sequences' caches (`tables`), each
    /// at its row's position on the device (`positions`, the batch's). The caches must have
    /// room (reserved by the caller).
    #[allow(clippy::too_many_arguments)]
    fn append_rows(&self, k: &View<CudaSlice<f32>>, v: &View<CudaSlice<f32>>, rows: usize, width: usize, positions: &CudaSlice<u32>, tables: &RowTables) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        let (n, w) = (int_arg("kv rows", rows)?, int_arg("kv width", width)?);
        let (k_off, v_off) = (long_arg(k.offset), long_arg(v.offset));
        let (k_ld, v_ld) = (long_arg(k.stride), long_arg(v.stride));
        let (kp, vp) = (g.ptr(k.buf), g.ptr(v.buf));
        let mut l = g.launch_builder(&self.append);
        l.arg(&kp).arg(&k_off).arg(&k_ld).arg(&vp).arg(&v_off).arg(&v_ld).arg(&n).arg(&w).buf(positions).buf(&*tables.k_at).buf(&*tables.v_at);
        let blocks = crate::cuda::grid_for(rows * width, 256)?.min(65_535);
        // SAFETY: argument types match tern_kv_append; the views hold the rows (checked by the
        // callers), whose positions lie inside their caches' reserved rows (the callers
        // reserved past + len rows for each sequence).
        unsafe { l.launch(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }) }
            .map_err(driver_err("launching tern_kv_append"))?;
        Ok(())
    }

    /// For each sequence: appends its rows of k and v to its cache, then its queries attend
    /// causally over the cache, times sigmoid(gate), into `out` [rows][q_heads·hd] (a decode
    /// step, one row a sequence, in one launch: the attention appends them itself). With `prep`
    /// (decode steps only), the q and k views hold the heads as projected and the launch
    /// prepares them itself, with the bits of [`crate::kernels::rope::cuda::RopeCuda::head_prep`]
    /// before it; the cache keeps the prepared keys. CPU twin: the CPU backend's kv_attention
    /// ([`super::causal_attention`] per sequence), after its head_prep with `prep`.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_attention(
        &self,
        q: View<CudaSlice<f32>>,
        k: View<CudaSlice<f32>>,
        v: View<CudaSlice<f32>>,
        gate: View<CudaSlice<f32>>,
        segments: &[Segment],
        past: &[usize],
        positions: &CudaSlice<u32>,
        caches: &mut [&mut GpuKv],
        shape: &AttentionShape,
        out: &mut CudaSlice<f32>,
        prep: Option<&KvHeadPrep>,
    ) -> Result<()> {
        let AttentionShape { q_heads, kv_heads, hd, scale, max_distance } = *shape;
        if kv_heads == 0 || q_heads % kv_heads != 0 || max_distance.is_some() || hd == 0 || hd > MAX_HEAD_DIM {
            return Err(Error::Shape(format!(
                "kv_attention: {q_heads} query heads over {kv_heads} kv heads of {hd} (at most {MAX_HEAD_DIM}), window {max_distance:?}"
            )));
        }
        let rows: usize = segments.iter().map(|s| s.len).sum();
        let (qw, kw) = (q_heads * hd, kv_heads * hd);
        check_view("kv_attention q", q.buf.len(), q.offset, q.stride, rows, qw)?;
        check_view("kv_attention gate", gate.buf.len(), gate.offset, gate.stride, rows, qw)?;
        check_view("kv_attention k", k.buf.len(), k.offset, k.stride, rows, kw)?;
        check_view("kv_attention v", v.buf.len(), v.offset, v.stride, rows, kw)?;
        check_len("kv_attention output", out.len(), rows * qw)?;
        if caches.len() != segments.len() || past.len() != segments.len() {
            return Err(Error::Shape(format!("kv_attention: {} caches and {} positions for {} sequences", caches.len(), past.len(), segments.len())));
        }
        check_len("kv_attention positions", positions.len(), rows)?;
        let g = &self.gpu;
        let (heads, kvh, hdi) = (int_arg("query heads", q_heads)?, int_arg("kv heads", kv_heads)?, int_arg("head dim", hd)?);
        for ((seg, cache), &past) in segments.iter().zip(caches.iter_mut()).zip(past) {
            if cache.width != kw || cache.rows != past {
                return Err(Error::Shape(format!(
                    "kv_attention: a sequence at position {past} has a cache of {} rows of {} (rows of {kw} expected)",
                    cache.rows, cache.width
                )));
            }
            int_arg("cache rows", past + seg.len)?;
            cache.reserve(g, past, past + seg.len)?;
        }
        if rows == 0 {
            return Ok(());
        }
        // Every sequence's rows in one launch of each kernel, each row finding its cache in
        // the tables.
        let tables = self.row_tables(segments, caches, rows)?;
        // A decode step (each sequence one new row): the attention kernel reads each row's own
        // key and value from the views and appends them itself; otherwise (a continued prompt,
        // whose rows also see each other's keys) they are appended first.
        let fresh = segments.iter().all(|s| s.len == 1);
        let prep = match prep {
            None => KvPrepArgs::default(),
            Some(_) if !fresh => return Err(Error::Shape("kv_attention: heads are prepared in the attention in decode steps only (one row a sequence)".into())),
            Some(p) => {
                let mut args = KvPrepArgs { on: 1, ..Default::default() };
                for (sec, (what, prep, view, heads)) in [("q", &p.q, &q, q_heads), ("k", &p.k, &k, kv_heads)].into_iter().enumerate() {
                    if prep.heads != heads || prep.hd != hd {
                        return Err(Error::Shape(format!("kv_attention: {what} heads prepared as {}×{}, attended as {heads}×{hd}", prep.heads, prep.hd)));
                    }
                    check_head_prep(
                        HeadPrepView { len: view.buf.len(), offset: view.offset, stride: view.stride, rows, heads, hd },
                        prep.norm.flatten().map(CudaSlice::len),
                        prep.rope.map(|t| (t.rot, t.positions)),
                        positions.len(),
                        Some(p.max_position),
                    )?;
                    args.w[sec] = g.ptr_opt(prep.norm.flatten());
                    args.norm[sec] = prep.norm.is_some() as i32;
                    args.eps[sec] = prep.eps;
                    if let Some(t) = prep.rope {
                        (args.cos[sec], args.sin[sec], args.rot[sec]) = (g.ptr(&t.cos), g.ptr(&t.sin), int_arg("rotated channels", t.rot)?);
                    }
                }
                args
            }
        };
        if !fresh {
            self.append_rows(&k, &v, rows, kw, positions, &tables)?;
        }
        let fresh = fresh as i32;
        let (q_off, g_off) = (long_arg(q.offset), long_arg(gate.offset));
        let (q_ld, g_ld) = (long_arg(q.stride), long_arg(gate.stride));
        let (k_off, v_off) = (long_arg(k.offset), long_arg(v.offset));
        let (k_ld, v_ld) = (long_arg(k.stride), long_arg(v.stride));
        let (qp, gp, kp, vp) = (g.ptr(q.buf), g.ptr(gate.buf), g.ptr(k.buf), g.ptr(v.buf));
        let KvForm { splits, warps } = self.form;
        let splits = kv_splits(rows, q_heads, hd, splits);
        // Split partials (unused with one split) and the heads' arrival counters.
        let partial = g.alloc::<f32>(if splits > 1 { rows * q_heads * splits * (hd + 2) } else { 1 })?;
        let own_counters;
        let counters = match &self.kept_counters {
            Some(kept) if rows * q_heads <= kept.len() => kept,
            _ => {
                own_counters = g.zeros::<u32>(rows * q_heads)?;
                &own_counters
            }
        };
        // hd <= MAX_HEAD_DIM = 32 · the last lane count (checked above).
        let kernels = if warps == KV_WARPS_WIDE { &self.attend_w16 } else { &self.attend };
        let attend = KV_LANE_VALUES.iter().position(|&per| 32 * per >= hd).map(|at| &kernels[at]).expect("hd <= MAX_HEAD_DIM");
        let mut l = g.launch_builder(attend);
        l.arg(&qp).arg(&q_off).arg(&q_ld).arg(&gp).arg(&g_off).arg(&g_ld);
        l.arg(&kp).arg(&k_off).arg(&k_ld).arg(&vp).arg(&v_off).arg(&v_ld).arg(&fresh).arg(&prep);
        l.buf(&*tables.k_at).buf(&*tables.v_at).buf(positions);
        // Keys a split takes at least (one round of the kernel's KB keys a warp: 2 for heads of
        // more than 256 values, else 4); 0 (TERN_KV_SHORT_SPLITS=0): every row takes `splits`.
        let min_keys: i32 = if self.short_splits { (warps * if hd > 256 { 2 } else { 4 }) as i32 } else { 0 };
        l.arg(&heads).arg(&kvh).arg(&hdi).arg(&scale).arg(&min_keys).buf(&partial).buf(counters).buf(out);
        let grid_rows = u32::try_from(rows).ok().filter(|&r| r <= 65_535).ok_or_else(|| {
            Error::Shape(format!("kv_attention: {rows} new rows, at most 65535 per launch"))
        })?;
        let cfg = LaunchConfig { grid_dim: (q_heads as u32, grid_rows, splits as u32), block_dim: (32 * warps as u32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match tern_kv_attention (prep: its heads' views, weights and
        // tables checked above, each table holding the batch's largest position); row i (position p_i, the batch's)
        // reads rows ≤ p_i of its own cache, which the append above filled or earlier steps
        // did (fresh: rows < p_i, and row p_i from the k, v views, which hold the rows:
        // checked, and which one block writes into the cache's reserved row p_i), and writes
        // its own output row inside `out` (checked); with several splits,
        // block (h, i, s) writes partial record (i, h, s) of rows × q_heads × splits records
        // of hd + 2 floats, and counter (i, h) of rows × q_heads.
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_kv_attention"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One sequence at a time takes the wide blocks, rounds the narrow ones; the switches
    /// override either, and every form chosen is one the kernels are built for.
    #[test]
    fn kv_form_follows_the_process_and_the_switches() {
        assert_eq!(KvForm::chosen(false, None, None), KvForm { splits: KV_SPLITS, warps: KV_WARPS_WIDE });
        assert_eq!(KvForm::chosen(true, None, None), KvForm { splits: KV_SPLITS, warps: KV_WARPS });
        assert_eq!(KvForm::chosen(true, Some("16"), Some("16")), KvForm { splits: KV_MAX_SPLITS, warps: KV_WARPS_WIDE });
        assert_eq!(KvForm::chosen(false, Some("8"), Some("4")), KvForm { splits: KV_SPLITS, warps: KV_WARPS });
        for batched in [false, true] {
            for splits in [None, Some("16"), Some("x")] {
                for warps in [None, Some("4"), Some("16"), Some("2")] {
                    assert!(KvForm::ALL.contains(&KvForm::chosen(batched, splits, warps)));
                }
            }
        }
    }

    /// The launcher's kernels and merge bound are the ones kv.cu defines, and its lane counts
    /// cover every head it accepts.
    #[test]
    fn kv_entries_match_the_launcher() {
        let code = include_str!("kv.cu");
        for per in KV_LANE_VALUES {
            assert_eq!(code.matches(&format!("\nTERN_KV_ATTENTION({per}, ")).count(), 1, "per {per}");
        }
        assert_eq!(code.matches("\nTERN_KV_ATTENTION(").count(), KV_LANE_VALUES.len());
        assert!(code.contains(&format!("#define TERN_KV_MAX_SPLITS {KV_MAX_SPLITS}\n")));
        // Block sizes: the launcher's warps are the kernels' (and the wide form's bound).
        assert!(code.contains(&format!("#define TERN_KV_WARPS {KV_WARPS}\n")));
        assert!(code.contains(&format!("_w16, PER, KB, {KV_WARPS_WIDE}, __launch_bounds__({})", 32 * KV_WARPS_WIDE)));
        assert_eq!(32 * KV_LANE_VALUES[KV_LANE_VALUES.len() - 1], MAX_HEAD_DIM);
    }

    #[test]
    fn kv_splits_depend_on_the_launch_size_only() {
        // Decode steps of 1 to 512 sequences (Qwen3.5-0.8B: 8 query heads of 256; 35B-A3B: 16):
        // the configured splits, whatever their caches hold.
        for splits in [KV_SPLITS, KV_MAX_SPLITS] {
            for rows in [1, 8, 128, 512] {
                assert_eq!(kv_splits(rows, 8, 256, splits), splits);
            }
            assert_eq!(kv_splits(512, 16, 256, splits), splits);
            // A continued prompt of thousands of rows runs unsplit.
            assert_eq!(kv_splits(4096, 8, 256, splits), 1);
        }
    }

    /// The launcher asks for tern_attention_tc_hd{HD}_bk{TC_KEY_TILE} and sizes its shared
    /// memory for that tile: the source must instantiate exactly those, and every size must
    /// fit the H200's 227 KB a block.
    #[test]
    fn tensor_core_entries_match_the_launcher() {
        let code = include_str!("attention_tc.cu");
        for hd in TC_HEAD_DIMS {
            assert!(code.contains(&format!("\nTERN_ATTENTION_TC_ENTRY({hd}, {TC_KEY_TILE})\n")), "hd {hd}");
            assert!(tc_smem_bytes(hd) <= 227 * 1024, "hd {hd}: {} bytes", tc_smem_bytes(hd));
        }
        assert_eq!(code.matches("\nTERN_ATTENTION_TC_ENTRY(").count(), TC_HEAD_DIMS.len());
    }
}
