//! L2 prefetch of a recorded decode step's weights, one or more products ahead of the product
//! that reads them (`tern_l2_prefetch` in gemv.cu).
//!
//! Why: a decode step of one sequence is a chain of ~110 small kernels, and the memory streams
//! weights only while a product runs; between products (a launch's wait, its first loads'
//! latency, its last blocks, and the norms, the recurrence and attention between the
//! products) it idles, which is most of what a Qwen3.5-0.8B step lacks of its weight roofline
//! (BENCHMARKS.md: products at 2.4–2.7× their bytes' time). Here a second stream, forked from
//! the step's stream inside its graph, requests the weights of the product after the next
//! while the next one runs, so that the memory keeps streaming through the gaps and each
//! product finds its weights in the L2 (50 MB on an H100; a product's weights are at most
//! ~17 MB in Qwen3.5-0.8B, and a vocabulary head is requested only in part).
//!
//! How the step's products are known ahead: a recorded step runs plainly once before it is
//! recorded ([`CudaOps::run_step`](crate::kernels::cuda_ops)); that run learns the order in
//! which its GEMV launches read their weights ([`WeightPrefetch::learn`]), and the recording
//! run, which queues the same launches, forks a prefetch before each ([`WeightPrefetch::read`]).
//! A recording whose launches differ from the learned order stops prefetching (it is a hint:
//! no result depends on it, so nothing else changes). The side stream joins the step's stream
//! before the recording ends ([`WeightPrefetch::join`]).
//!
//! Off unless TERN_L2_PREFETCH=N (N products ahead) while it is measured.

use std::sync::{Arc, Mutex};

use crate::cuda::{driver_err, CudaEvent, CudaFunction, CudaStream, Gpu, LaunchConfig};
use crate::error::Result;
use cudarc::driver::PushKernelArg;

/// Weights one launch reads: (device address, bytes) of each part's matrix (Q8_0: its quants
/// and its scales).
pub type WeightRegions = Vec<(u64, usize)>;

/// Bytes of one region requested at most: a vocabulary head (508 MB in bf16) is requested in
/// part, so that the prefetch does not evict the product it runs beside.
const PREFETCH_MAX_BYTES: usize = 24 << 20;
/// Lines (128 bytes) a thread of `tern_l2_prefetch` requests, about.
const LINES_PER_THREAD: usize = 16;
const PREFETCH_THREADS: u32 = 256;

enum State {
    Idle,
    /// A plain run noting each GEMV launch's weights in order.
    Learning(Vec<WeightRegions>),
    /// A recording queuing a prefetch before each launch: the learned order, the next launch's
    /// index in it, and the events the forks recorded (kept until the recording ends).
    Recording { order: Vec<WeightRegions>, at: usize, events: Vec<CudaEvent>, forked: bool },
}

pub struct WeightPrefetch {
    gpu: Arc<Gpu>,
    /// Products ahead of the one about to run whose weights are requested; 0: off.
    ahead: usize,
    kernel: CudaFunction,
    side: Option<Arc<CudaStream>>,
    max_blocks: u32,
    state: Mutex<State>,
}

impl WeightPrefetch {
    pub fn new(gpu: Arc<Gpu>, kernel: CudaFunction, multiprocessors: usize) -> Result<Self> {
        let ahead = std::env::var("TERN_L2_PREFETCH").ok().and_then(|v| v.parse().ok()).unwrap_or(0usize);
        WeightPrefetch { gpu, ahead: 0, kernel, side: None, max_blocks: 2 * multiprocessors as u32, state: Mutex::new(State::Idle) }.with_ahead(ahead)
    }

    /// This prefetch `ahead` products ahead (0: off), whatever TERN_L2_PREFETCH says.
    pub fn with_ahead(mut self, ahead: usize) -> Result<Self> {
        if ahead > 0 && self.side.is_none() {
            self.side = Some(self.gpu.context().new_stream().map_err(driver_err("creating the prefetch stream"))?);
        }
        self.ahead = ahead;
        Ok(self)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts noting the order of the GEMV launches' weights (a decode step's plain first run).
    pub fn learn(&self) {
        if self.ahead > 0 {
            *self.state() = State::Learning(Vec::new());
        }
    }

    /// The order noted since [`WeightPrefetch::learn`], if it was.
    pub fn learned(&self) -> Option<Vec<WeightRegions>> {
        match std::mem::replace(&mut *self.state(), State::Idle) {
            State::Learning(order) => Some(order),
            _ => None,
        }
    }

    /// Starts prefetching along `order` on the stream being recorded: the first `ahead`
    /// products' weights at once (they stream while the step's first kernels run).
    pub fn record(&self, order: Vec<WeightRegions>) -> Result<()> {
        if self.ahead == 0 || order.is_empty() {
            return Ok(());
        }
        let mut st = State::Recording { order, at: 0, events: Vec::new(), forked: false };
        let ahead = self.ahead;
        if let State::Recording { order, events, forked, .. } = &mut st {
            for regions in order.iter().take(ahead) {
                self.fork(regions, events, forked)?;
            }
        }
        *self.state() = st;
        Ok(())
    }

    /// A GEMV launch about to be queued reads `regions`: noted while learning; while recording,
    /// the weights `ahead` products later are requested first (or, if the launch is not the
    /// one learned, prefetching stops for the rest of the recording).
    pub fn read(&self, regions: impl FnOnce() -> WeightRegions) -> Result<()> {
        if self.ahead == 0 {
            return Ok(());
        }
        let mut guard = self.state();
        match &mut *guard {
            State::Idle => Ok(()),
            State::Learning(order) => {
                order.push(regions());
                Ok(())
            }
            State::Recording { order, at, events, forked } => {
                if *at >= order.len() || order[*at] != regions() {
                    *at = usize::MAX;
                    order.clear();
                    return Ok(());
                }
                let next = *at + self.ahead;
                *at += 1;
                match order.get(next) {
                    Some(r) => {
                        let r = r.clone();
                        self.fork(&r, events, forked)
                    }
                    None => Ok(()),
                }
            }
        }
    }

    /// The side stream's prefetch of `regions`, after everything queued on the step's stream
    /// so far.
    fn fork(&self, regions: &WeightRegions, events: &mut Vec<CudaEvent>, forked: &mut bool) -> Result<()> {
        let Some(side) = &self.side else { return Ok(()) };
        let event = self.gpu.context().new_event(None).map_err(driver_err("creating a prefetch event"))?;
        event.record(self.gpu.stream()).map_err(driver_err("recording a prefetch event"))?;
        side.wait(&event).map_err(driver_err("forking the prefetch stream"))?;
        events.push(event);
        *forked = true;
        for &(ptr, bytes) in regions {
            let bytes = bytes.min(PREFETCH_MAX_BYTES) as u64;
            let lines = bytes.div_ceil(128) as usize;
            let blocks = lines.div_ceil(PREFETCH_THREADS as usize * LINES_PER_THREAD).clamp(1, self.max_blocks as usize) as u32;
            let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (PREFETCH_THREADS, 1, 1), shared_mem_bytes: 0 };
            let mut l = side.launch_builder(&self.kernel);
            l.arg(&ptr).arg(&bytes);
            // SAFETY: tern_l2_prefetch(const char*, unsigned long long) takes an address and a
            // byte count; it only requests lines of [ptr, ptr + bytes) (a weight buffer's own
            // bytes, or fewer) into L2, and writes nothing.
            unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_l2_prefetch"))?;
        }
        Ok(())
    }

    /// Joins the side stream into the step's stream (a recording must end with every stream it
    /// forked joined) and ends the recording's prefetch, whatever its state.
    pub fn join(&self) -> Result<()> {
        let state = std::mem::replace(&mut *self.state(), State::Idle);
        if let (State::Recording { forked: true, events, .. }, Some(side)) = (state, &self.side) {
            self.gpu.stream().join(side).map_err(driver_err("joining the prefetch stream"))?;
            drop(events);
        }
        Ok(())
    }
}
