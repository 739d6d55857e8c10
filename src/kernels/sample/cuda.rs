//! Launcher of `select.cu`: each sequence's wanted best entries of a step's logits, picked on
//! the device so that only they cross to the host. CPU twin: [`super::best_entries`].

use std::sync::{Arc, Mutex};

use crate::cuda::{driver_err, int_arg, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig};
use crate::error::{Error, Result};
use crate::kernels::check_len;

use super::{check_wants, LogitsWant, MAX_BEST};

pub const SOURCE: KernelSource =
    KernelSource { name: "tern_select", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("select.cu")) };

/// Block sizes of the kernels (TERN_SELECT_THREADS, TERN_GREEDY_THREADS).
const SELECT_THREADS: u32 = 1024;
const GREEDY_THREADS: u32 = 256;
/// Entries a thread of the greedy kernel reads, at least: a row's blocks are its length over
/// this many per block (a 248 320-entry row: 122 blocks).
const GREEDY_PER_THREAD: usize = 8;

pub struct SelectCuda {
    gpu: Arc<Gpu>,
    greedy: CudaFunction,
    select: CudaFunction,
    /// The last call's row parameters and their device copy: decode steps of one batch ask
    /// the same of every step, and an upload of a few words costs a host-side copy a step.
    params: Mutex<Option<(Vec<u32>, CudaSlice<u32>)>>,
}

/// A rank key back to its value (the inverse of the kernels' and [`super::rank_key`]'s map).
fn key_value(key: u32) -> f32 {
    f32::from_bits(if key & 0x8000_0000 != 0 { key & 0x7fff_ffff } else { !key })
}

impl SelectCuda {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        Ok(SelectCuda {
            greedy: gpu.function(&SOURCE, "tern_best_greedy")?,
            select: gpu.function(&SOURCE, "tern_best_select")?,
            params: Mutex::new(None),
            gpu,
        })
    }

    /// For each row of `logits` ([wants.len()][vocab]) that asks for its best entries, those
    /// entries (best first; see [`super::best_entries`]); None for the rows that want the whole
    /// row (the caller copies those).
    pub fn best(&self, logits: &CudaSlice<f32>, vocab: usize, wants: &[LogitsWant]) -> Result<Vec<Option<Vec<(u32, f32)>>>> {
        check_wants(wants)?;
        let rows = wants.len();
        check_len("best logits input", logits.len(), rows * vocab)?;
        if rows == 0 || vocab == 0 {
            return Ok(wants.iter().map(|w| matches!(w, LogitsWant::Best { .. }).then(Vec::new)).collect());
        }
        let g = &self.gpu;
        // One upload: the rows' divisors (f32 bits), then their counts (0: the whole row).
        let mut params = vec![0u32; 2 * rows];
        let mut stride = 0usize;
        let (mut any_greedy, mut any_select) = (false, false);
        for (r, w) in wants.iter().enumerate() {
            if let LogitsWant::Best { divisor, count } = *w {
                params[r] = divisor.to_bits();
                params[rows + r] = count as u32;
                if w.is_argmax() {
                    any_greedy = true;
                } else {
                    any_select = true;
                    stride = stride.max(count);
                }
            }
        }
        if !any_greedy && !any_select {
            // Every row is wanted whole: nothing to pick.
            return Ok(vec![None; rows]);
        }
        debug_assert!(stride <= MAX_BEST);
        let v = int_arg("best logits vocabulary", vocab)?;
        let n_rows = u32::try_from(rows).ok().filter(|&n| n <= 65_535).ok_or_else(|| Error::Shape(format!("best logits: {rows} rows in one launch")))?;
        let mut cached = self.params.lock().unwrap_or_else(|p| p.into_inner());
        if cached.as_ref().is_none_or(|(host, _)| *host != params) {
            let device = g.upload(&params)?;
            *cached = Some((params, device));
        }
        let divisors = g.ptr(&cached.as_ref().expect("set just above").1);
        let counts = divisors + 4 * rows as u64;
        let lp = g.ptr(logits);

        // Both kernels queued, then one wait for their results.
        let greedy = if any_greedy {
            let best = g.zeros::<u64>(rows)?;
            let bp = g.ptr(&best);
            let blocks = vocab.div_ceil(GREEDY_THREADS as usize * GREEDY_PER_THREAD).clamp(1, 1024) as u32;
            let mut l = g.launch_builder(&self.greedy);
            l.arg(&lp).arg(&v).arg(&divisors).arg(&counts).arg(&bp);
            let cfg = LaunchConfig { grid_dim: (blocks, n_rows, 1), block_dim: (GREEDY_THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: argument types match tern_best_greedy; logits hold rows × vocab floats,
            // params 2 × rows words, best one word a row.
            unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_best_greedy"))?;
            Some(best)
        } else {
            None
        };
        let picked = if any_select {
            let (mut ids, mut values) = (g.alloc::<u32>(rows * stride)?, g.alloc::<f32>(rows * stride)?);
            // An entry left unwritten reads as (u32::MAX, NaN); padding is (u32::MAX, 0).
            g.poison(&mut ids)?;
            g.poison(&mut values)?;
            let (ip, vp, s) = (g.ptr(&ids), g.ptr(&values), int_arg("best logits count", stride)?);
            let mut l = g.launch_builder(&self.select);
            l.arg(&lp).arg(&v).arg(&divisors).arg(&counts).arg(&s).arg(&ip).arg(&vp);
            let cfg = LaunchConfig { grid_dim: (n_rows, 1, 1), block_dim: (SELECT_THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: argument types match tern_best_select; each selecting row writes its first
            // `count` <= stride entries of ids and values ([rows][stride]); the host reads no more.
            unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_best_select"))?;
            Some((ids, values))
        } else {
            None
        };
        let greedy = greedy.map(|b| g.download(&b)).transpose()?;
        let picked = match picked {
            Some((ids, values)) => Some((g.download(&ids)?, g.download(&values)?)),
            None => None,
        };

        wants
            .iter()
            .enumerate()
            .map(|(r, w)| match *w {
                LogitsWant::Full => Ok(None),
                LogitsWant::Best { .. } if w.is_argmax() => {
                    let packed = greedy.as_ref().map_or(0, |b| b[r]);
                    // 0: the row had no non-NaN entry.
                    Ok(Some(if packed == 0 { Vec::new() } else { vec![(!(packed as u32), key_value((packed >> 32) as u32))] }))
                }
                LogitsWant::Best { count, .. } => {
                    let (ids, values) = picked.as_ref().expect("a selecting row launched the select kernel");
                    let at = r * stride;
                    let mut best = Vec::with_capacity(count);
                    for (&id, &v) in ids[at..at + count].iter().zip(&values[at..at + count]) {
                        if v.is_nan() {
                            return Err(Error::Cuda(format!("tern_best_select left entries of row {r} unwritten")));
                        }
                        if id == u32::MAX {
                            break;
                        }
                        best.push((id, v));
                    }
                    Ok(Some(best))
                }
            })
            .collect()
    }
}
