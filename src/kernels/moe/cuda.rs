//! Launchers of `moe.cu`, with the checks of the CPU twins in this folder. Rows are routed on
//! the device ([`MoeCuda::route`]; on the host, [`super::route`], past its limits), then:
//! - many rows (a prompt): the ids come back to the host, which sorts the (row, choice) slots
//!   by expert; while the experts get few rows each, GEMVs run over tiles of up to 8 of an
//!   expert's rows, one launch a product ([`crate::kernels::matmul::cuda::Blas::tiles`]), else
//!   each expert's products run once over its slice of the gathered rows
//!   ([`crate::kernels::matmul::cuda::Blas::grouped_linear`]); [`MoeCuda::combine`] reads
//!   each slot's output back by its sorted position; for steps of few rows (a decode round of
//!   many sequences; TERN_MOE_DEVICE_SORT=1 for all) the slots are sorted and their tiles made
//!   on the device instead ([`MoeCuda::sort_slots`],
//!   [`crate::kernels::matmul::cuda::Blas::tiles_counted`], [`MoeCuda::combine_sorted`]), so
//!   that nothing returns to the host;
//! - a few rows (a decode step): the products read each slot's expert from the ids on the
//!   device ([`crate::kernels::matmul::cuda::Blas::routed`]) and [`MoeCuda::combine`] adds them
//!   up (for one row, the down products, their sum, the residual step and the norm are one
//!   launch: [`crate::kernels::matmul::cuda::Blas::routed_residual_norm`]): nothing goes back
//!   to the host, so the step can be recorded as a graph. A shared
//!   expert of the routed experts' shape is one more slot of each row there (its gate's
//!   sigmoid as the weight, added last), so its products cost no launches of their own;
//!   elsewhere it runs as a dense MLP and [`MoeCuda::add_sigmoid_gated`] adds it.

use std::sync::Arc;

use crate::cuda::{driver_err, grid_for, int_arg, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig};
use crate::error::{Error, Result};
use crate::kernels::check_len;

pub const SOURCE: KernelSource =
    KernelSource { name: "tern_moe", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("moe.cu")) };

pub struct MoeCuda {
    gpu: Arc<Gpu>,
    gated: CudaFunction,
    route: CudaFunction,
    combine: CudaFunction,
    sort: CudaFunction,
}

/// Experts the device sort of a prompt's slots takes (`tern_moe_sort_slots`: one thread an
/// expert, one block).
pub const MAX_SORT_EXPERTS: usize = 1024;
/// Rows of a tile of the device sort (moe.cu's TERN_MOE_TILE_ROWS): the GEMV's row limit.
const SORT_TILE_ROWS: usize = crate::kernels::matmul::cuda::GEMV_MAX_ROWS;

/// A prompt's slots sorted by expert on the device ([`MoeCuda::sort_slots`]): `pos[s]` the
/// sorted row of slot s, `token[r]` the input row of sorted row r, and the tiles (expert, first
/// row, rows) of each expert's sorted rows, `n_tiles[0]` of them in room for `max_tiles`.
pub struct SortedSlots {
    pub token: CudaSlice<u32>,
    pub pos: CudaSlice<u32>,
    pub tiles: CudaSlice<i32>,
    pub n_tiles: CudaSlice<i32>,
    pub max_tiles: usize,
}

/// The slots of a prompt's MoE sorted by expert on the host: `start[e]..start[e + 1]` are
/// expert e's sorted rows, `pos[s]` the sorted row of slot s, `token[r]` the input row of
/// sorted row r.
pub struct SlotOrder {
    pub start: Vec<usize>,
    pub token: Vec<u32>,
    pub pos: Vec<u32>,
}

/// Counting sort of the slots `ids` ([rows][k] experts below `ne`) by expert, each expert's
/// slots in slot order: the order [`MoeCuda::sort_slots`] gives on the device (its CPU twin).
pub fn sort_slots_on_host(ids: &[usize], k: usize, ne: usize) -> SlotOrder {
    let mut start = vec![0usize; ne + 1];
    for &e in ids {
        start[e + 1] += 1;
    }
    for e in 0..ne {
        start[e + 1] += start[e];
    }
    let (mut fill, mut token, mut pos) = (start.clone(), vec![0u32; ids.len()], vec![0u32; ids.len()]);
    for (slot, &e) in ids.iter().enumerate() {
        let at = fill[e];
        fill[e] += 1;
        (token[at], pos[slot]) = ((slot / k) as u32, at as u32);
    }
    SlotOrder { start, token, pos }
}

impl SortedSlots {
    /// Room for the tiles of `slots` slots over `ne` experts: an expert of c slots has
    /// ceil(c / 8) <= c / 8 + 1 tiles, and at most min(ne, slots) experts have any.
    pub fn max_tiles(slots: usize, ne: usize) -> usize {
        slots.div_ceil(SORT_TILE_ROWS) + ne.min(slots)
    }
}

/// Choices per row the device routing takes (each is held by one lane of the row's warp,
/// which would allow 32); past it the host routes.
pub const MAX_DEVICE_TOP_K: usize = 16;
/// Experts whose probabilities fit the routing block's shared memory at the default limit.
pub const MAX_DEVICE_EXPERTS: usize = 12 * 1024;

fn grid(n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig { grid_dim: (grid_for(n, 256)?.min(65_535), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
}

impl MoeCuda {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        Ok(MoeCuda {
            gated: gpu.function(&SOURCE, "tern_add_sigmoid_gated")?,
            route: gpu.function(&SOURCE, "tern_moe_route")?,
            combine: gpu.function(&SOURCE, "tern_moe_combine")?,
            sort: gpu.function(&SOURCE, "tern_moe_sort_slots")?,
            gpu,
        })
    }

    /// Routes the rows of router logits ([rows][stride], the experts' logits first) on the
    /// device: each row's top-k experts (ascending) in `ids` and their renormalised weights in
    /// `weights`, [rows][k]; with `shared`, column `ne` is the shared expert's gate logit and
    /// each row gets one more slot, [rows][k + 1]: id `ne`, weight sigmoid(gate). CPU twin:
    /// [`super::route`] (and the CPU backend's sigmoid gate of the shared expert).
    #[allow(clippy::too_many_arguments)]
    pub fn route(&self, logits: &CudaSlice<f32>, ne: usize, stride: usize, k: usize, shared: bool, ids: &mut CudaSlice<i32>, weights: &mut CudaSlice<f32>) -> Result<()> {
        if ne == 0 || k == 0 || k > ne || k > MAX_DEVICE_TOP_K || ne > MAX_DEVICE_EXPERTS || stride < ne + shared as usize || logits.len() % stride != 0 {
            return Err(Error::Shape(format!(
                "moe routing on the device: top-{k} of {ne} experts over {} logits in rows of {stride} (at most top-{MAX_DEVICE_TOP_K} of {MAX_DEVICE_EXPERTS})",
                logits.len()
            )));
        }
        let rows = logits.len() / stride;
        let slots = rows * (k + shared as usize);
        check_len("moe route ids", ids.len(), slots)?;
        check_len("moe route weights", weights.len(), slots)?;
        if rows == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        let (nei, si, ki, shi) = (int_arg("experts", ne)?, int_arg("logit stride", stride)?, int_arg("top-k", k)?, shared as i32);
        let (lp, ip, wp) = (g.ptr(logits), g.ptr(ids), g.ptr(weights));
        let mut l = g.launch_builder(&self.route);
        l.arg(&lp).arg(&nei).arg(&si).arg(&ki).arg(&shi).arg(&ip).arg(&wp);
        let cfg = LaunchConfig { grid_dim: (grid_for(rows, 1)?, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: (4 * ne) as u32 };
        // SAFETY: argument types match tern_moe_route; one warp per row reads its ne (+ 1)
        // logits and writes k (+ 1) ids (each at most ne) and weights; ne floats of shared
        // memory (<= 48 KB).
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_moe_route"))?;
        Ok(())
    }

    /// out[r] = Σ_j y[s]·weights[r·k + j], rows of `d`, the choices added in order from zero;
    /// s is the slot r·k + j, or with `pos` the row pos[r·k + j] of y that holds that slot's
    /// output (rows of a prompt's experts sorted by expert; uploaded here). CPU twin: the
    /// accumulation in [`super::moe_experts`].
    pub fn combine(&self, y: &CudaSlice<f32>, pos: Option<&[u32]>, weights: &CudaSlice<f32>, k: usize, d: usize, out: &mut CudaSlice<f32>) -> Result<()> {
        let rows = self.combine_rows(y, weights, k, d, out)?;
        if let Some(p) = pos {
            check_len("moe combine positions", p.len(), rows * k)?;
            if let Some(&bad) = p.iter().find(|&&s| s as usize >= rows * k) {
                return Err(Error::Shape(format!("moe combine: position {bad} of {} outputs", rows * k)));
            }
        }
        let pos = pos.filter(|_| rows > 0).map(|p| self.gpu.upload(p)).transpose()?;
        self.launch_combine(y, pos.as_ref(), weights, k, d, out)
    }

    /// [`Self::combine`] through positions made on the device by [`Self::sort_slots`] (each
    /// below rows × k by construction), which the host neither reads nor uploads.
    pub fn combine_sorted(&self, y: &CudaSlice<f32>, pos: &CudaSlice<u32>, weights: &CudaSlice<f32>, k: usize, d: usize, out: &mut CudaSlice<f32>) -> Result<()> {
        let rows = self.combine_rows(y, weights, k, d, out)?;
        check_len("moe combine positions", pos.len(), rows * k)?;
        self.launch_combine(y, Some(pos), weights, k, d, out)
    }

    /// The combine's shape checks: its output rows.
    fn combine_rows(&self, y: &CudaSlice<f32>, weights: &CudaSlice<f32>, k: usize, d: usize, out: &CudaSlice<f32>) -> Result<usize> {
        if d == 0 || k == 0 || out.len() % d != 0 {
            return Err(Error::Shape(format!("moe combine: {} outputs as rows of {d}, {k} choices", out.len())));
        }
        let rows = out.len() / d;
        check_len("moe combine weights", weights.len(), rows * k)?;
        check_len("moe combine input", y.len(), rows * k * d)?;
        Ok(rows)
    }

    fn launch_combine(&self, y: &CudaSlice<f32>, pos: Option<&CudaSlice<u32>>, weights: &CudaSlice<f32>, k: usize, d: usize, out: &mut CudaSlice<f32>) -> Result<()> {
        let rows = out.len() / d;
        if rows == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        let (ri, ki, di) = (int_arg("rows", rows)?, int_arg("top-k", k)?, int_arg("width", d)?);
        let (yp, wp, pp, op) = (g.ptr(y), g.ptr(weights), g.ptr_opt(pos), g.ptr(out));
        let mut l = g.launch_builder(&self.combine);
        l.arg(&yp).arg(&wp).arg(&pp).arg(&ri).arg(&ki).arg(&di).arg(&op);
        // SAFETY: argument types match tern_moe_combine; y holds rows × k × d, weights (and
        // pos, each value below rows × k) rows × k and out rows × d (checked).
        unsafe { l.launch(grid(rows * d)?) }.map_err(driver_err("launching tern_moe_combine"))?;
        Ok(())
    }

    /// Sorts the slots of `ids` ([rows][k] experts below `ne`, as [`Self::route`] writes them)
    /// by expert on the device: the host's sort (slots of an expert in slot order) and its
    /// tiles ([`crate::kernels::matmul::cuda::expert_tiles`]), with nothing read back.
    pub fn sort_slots(&self, ids: &CudaSlice<i32>, k: usize, ne: usize) -> Result<SortedSlots> {
        let (slots, g) = (ids.len(), &self.gpu);
        let max_tiles = SortedSlots::max_tiles(slots, ne);
        let mut sorted = SortedSlots { token: g.alloc(slots)?, pos: g.alloc(slots)?, tiles: g.alloc(3 * max_tiles)?, n_tiles: g.alloc(1)?, max_tiles };
        self.sort_slots_into(ids, k, ne, &mut sorted)?;
        Ok(sorted)
    }

    /// [`Self::sort_slots`] into buffers already made for as many slots and experts.
    pub fn sort_slots_into(&self, ids: &CudaSlice<i32>, k: usize, ne: usize, sorted: &mut SortedSlots) -> Result<()> {
        if k == 0 || ids.len() % k != 0 || ne == 0 || ne > MAX_SORT_EXPERTS {
            return Err(Error::Shape(format!("moe sort on the device: {} slots of top-{k} over {ne} experts (at most {MAX_SORT_EXPERTS})", ids.len())));
        }
        let slots = ids.len();
        let max_tiles = SortedSlots::max_tiles(slots, ne);
        check_len("moe sort positions", sorted.pos.len(), slots)?;
        check_len("moe sort tokens", sorted.token.len(), slots)?;
        check_len("moe sort tiles", sorted.tiles.len(), 3 * max_tiles)?;
        check_len("moe sort tile count", sorted.n_tiles.len(), 1)?;
        sorted.max_tiles = max_tiles;
        let g = &self.gpu;
        let (si, ki, ni) = (int_arg("slots", slots)?, int_arg("top-k", k)?, int_arg("experts", ne)?);
        let (ip, tp, pp, tl, np) = (g.ptr(ids), g.ptr(&sorted.token), g.ptr(&sorted.pos), g.ptr(&sorted.tiles), g.ptr(&sorted.n_tiles));
        let mut l = g.launch_builder(&self.sort);
        l.arg(&ip).arg(&si).arg(&ki).arg(&ni).arg(&tp).arg(&pp).arg(&tl).arg(&np);
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (MAX_SORT_EXPERTS as u32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match tern_moe_sort_slots; ids, token and pos hold `slots`
        // entries, tiles room for max_tiles (what the slots can make) and n_tiles one; the ids
        // are experts below ne (the routing kernel's output), so every slot gets a position.
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_moe_sort_slots"))?;
        Ok(())
    }

    /// out[r] += sigmoid(gate[r·stride + at])·y[r], rows of `d` (the shared expert's gate: a
    /// column of the router's output). CPU twin: the CPU backend's shared expert in its moe.
    pub fn add_sigmoid_gated(&self, out: &mut CudaSlice<f32>, y: &CudaSlice<f32>, gate: &CudaSlice<f32>, at: usize, stride: usize, d: usize) -> Result<()> {
        check_len("add_sigmoid_gated input", y.len(), out.len())?;
        if d == 0 || out.len() % d != 0 || at >= stride || gate.len() != out.len() / d * stride {
            return Err(Error::Shape(format!("add_sigmoid_gated: {} outputs in rows of {d}, gates at {at} of rows of {stride} in {}", out.len(), gate.len())));
        }
        if out.is_empty() {
            return Ok(());
        }
        let g = &self.gpu;
        let (n, dw, gs) = (int_arg("gated rows", out.len() / d)?, int_arg("gated width", d)?, int_arg("gate stride", stride)?);
        let (op, yp, gp) = (g.ptr(out), g.ptr(y), g.ptr(gate) + 4 * at as u64);
        let mut l = g.launch_builder(&self.gated);
        l.arg(&op).arg(&yp).arg(&gp).arg(&gs).arg(&n).arg(&dw);
        // SAFETY: argument types match; out and y hold n × d, gate n rows of `stride` with
        // column `at` inside them (checked).
        unsafe { l.launch(grid(out.len())?) }.map_err(driver_err("launching tern_add_sigmoid_gated"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sort kernel's block and tile size are written in moe.cu as numbers: they must be
    /// the launcher's thread count and the GEMV's row limit.
    #[test]
    fn sort_kernel_constants_match_the_launcher() {
        let code = include_str!("moe.cu");
        assert!(code.contains(&format!("#define TERN_MOE_SORT_THREADS {MAX_SORT_EXPERTS}\n")));
        assert!(code.contains(&format!("#define TERN_MOE_TILE_ROWS {SORT_TILE_ROWS}\n")));
        // Room for the tiles: 17 slots of one expert make 3 tiles; 17 slots over 17 experts 17.
        assert!(SortedSlots::max_tiles(17, 1) >= 3);
        assert!(SortedSlots::max_tiles(17, 256) >= 17);
        assert_eq!(SortedSlots::max_tiles(0, 256), 0);
    }

    #[test]
    fn host_sort_keeps_slot_order_within_an_expert() {
        // Rows of top-2: (0, 2), (1, 2), (0, 1) over 3 experts.
        let o = sort_slots_on_host(&[0, 2, 1, 2, 0, 1], 2, 3);
        assert_eq!(o.start, vec![0, 2, 4, 6]);
        // Expert 0: slots 0, 4 (rows 0, 2); 1: slots 2, 5 (rows 1, 2); 2: slots 1, 3 (rows 0, 1).
        assert_eq!(o.token, vec![0, 2, 1, 2, 0, 1]);
        assert_eq!(o.pos, vec![0, 4, 2, 5, 1, 3]);
    }
}
