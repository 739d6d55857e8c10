//! The CUDA backend's device plumbing, shared by every kernel family: finding a GPU without
//! panicking when there is none, one context and stream per device, run-time compilation of the
//! families' CUDA sources with NVRTC (cached on disk, see [`nvrtc`]), device buffers, and the
//! mapping of every driver error into tern's [`Error`].
//!
//! The driver library is opened at run time (cudarc's `dynamic-loading`), so a machine without
//! CUDA runs the same binary on the CPU. cudarc panics when it cannot load libcuda, so
//! [`driver_available`] opens the library itself first and nothing here touches cudarc before
//! that probe has succeeded.
//!
//! Kernel sources live beside their CPU twins (`src/kernels/<family>/cuda/*.cu`) and are listed
//! in [`sources`], which the CI compile check walks.

pub mod nvrtc;
#[cfg(test)]
pub(crate) mod test_util;

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

pub use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use cudarc::driver::{CudaModule, DeviceRepr, DriverError, PinnedHostSlice, ValidAsZeroBits};

use crate::error::{Error, Result};

/// One CUDA translation unit of a kernel family.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// Unique name: the NVRTC program name and the cache file's prefix.
    pub name: &'static str,
    pub code: &'static str,
}

/// For kernel work on a machine that has a GPU but no Rust toolchain: with
/// `TERN_CUDA_SOURCE_DIR` set, a module whose file `<dir>/<name>.cu` exists (the whole program
/// text, prelude included, as [`KernelSource::code`] holds it) is compiled from that file
/// instead of the built-in source, so that a variant of a kernel can be measured with the same
/// binary. Said on stderr, since the results are then not those of the built-in kernels.
fn source_override(name: &str) -> Result<Option<String>> {
    source_override_in(std::env::var_os("TERN_CUDA_SOURCE_DIR").as_deref().map(Path::new), name)
}

/// [`source_override`] with the folder given (None: no override).
fn source_override_in(dir: Option<&Path>, name: &str) -> Result<Option<String>> {
    let Some(dir) = dir else { return Ok(None) };
    let path = dir.join(format!("{name}.cu"));
    if !path.exists() {
        return Ok(None);
    }
    eprintln!("tern: module {name} compiled from {} (TERN_CUDA_SOURCE_DIR)", path.display());
    std::fs::read_to_string(&path).map(Some).map_err(|e| Error::Cuda(format!("reading {}: {e}", path.display())))
}

/// The NVRTC target for a device of compute capability `major.minor`: its own architecture, and
/// on sm_90 (H100, H200) the arch-specific sm_90a, without which the warpgroup products
/// (src/kernels/wgmma.cuh) do not exist. A module is compiled for the device it runs on, so
/// the arch-specific target costs no portability; code without such instructions compiles to
/// the same registers either way (checked on every module when the target changed).
pub fn nvrtc_arch(major: i32, minor: i32) -> String {
    let specific = if (major, minor) == (9, 0) { "a" } else { "" };
    format!("sm_{major}{minor}{specific}")
}

/// Every CUDA source of the op set (the CI compile check covers exactly these).
pub fn sources() -> Vec<KernelSource> {
    let mut all = crate::kernels::gated_delta::cuda::SOURCES.to_vec();
    all.extend_from_slice(crate::kernels::cuda_ops::SOURCES);
    all
}

/// Device byte ranges `[start, end)` of recurrent states a kernel reads or writes.
pub type StateRanges = Vec<(u64, u64)>;

/// [`Gpu::state_reads_may_lead`] from the launch counts: `writer_at` the count when the last
/// state writer was launched and `written` the states it writes, `ordered_at` when the last
/// kernel that awaits its predecessor before letting the next be scheduled was, `read` the
/// states the kernel launched now reads. Kernels launched after `ordered_at` let the next be
/// scheduled early and write no state, so a kernel launched now may start while they and the
/// `ordered_at` kernel run, never an earlier one: only that kernel's writes can race the reads.
/// (The ranges are compared only where that kernel is the writer: a round of many sequences
/// has many of each.)
fn state_reads_may_lead(dependent: bool, writer_at: u64, ordered_at: u64, written: &[(u64, u64)], read: &[(u64, u64)]) -> bool {
    let overlap = || written.iter().any(|&(ws, we)| read.iter().any(|&(rs, re)| rs < we && ws < re));
    dependent && (writer_at != ordered_at || !overlap())
}

/// Maps a driver error into tern's error, naming the operation.
pub(crate) fn driver_err(what: &str) -> impl FnOnce(DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e:?}"))
}

/// Whether the CUDA driver library can be opened. Cached; safe to call anywhere.
pub fn driver_available() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        // The names cudarc's loader tries on Linux, most specific first.
        ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
            // SAFETY: opening the driver runs its initialisers, which have no preconditions;
            // the handle is closed again, cudarc opens its own.
            unsafe { libloading::Library::new(*name) }.is_ok()
        })
    })
}

/// Whether cuBLAS 13 can be opened (the library names cudarc's loader tries). cudarc panics
/// when it cannot load it, so [`crate::kernels::matmul::cuda::Blas::new`] asks here first.
pub fn cublas_available() -> Result<()> {
    static FOUND: OnceLock<bool> = OnceLock::new();
    let found = *FOUND.get_or_init(|| {
        ["libcublas.so.13", "libcublas.so"].iter().any(|name| {
            // SAFETY: as in driver_available; cuBLAS's initialisers have no preconditions.
            unsafe { libloading::Library::new(*name) }.is_ok()
        })
    });
    if found {
        Ok(())
    } else {
        Err(Error::Cuda(
            "cuBLAS 13 (libcublas.so.13) cannot be loaded: install the CUDA 13 toolkit or the nvidia-cublas wheel and \
             put its lib folder on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// Blocks of `block` threads covering `n` items, as a grid dimension.
pub fn grid_for(n: usize, block: u32) -> Result<u32> {
    u32::try_from(n.div_ceil(block as usize).max(1)).map_err(|_| Error::Shape(format!("{n} items: too many for one launch")))
}

/// `n` as a kernel's 32-bit int argument.
pub fn int_arg(what: &str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::Shape(format!("{what}: {n} does not fit the device's 32-bit index")))
}

/// `n` as a kernel's 64-bit offset or stride argument.
pub fn long_arg(n: usize) -> i64 {
    n as i64
}

/// Number of CUDA devices; 0 without a driver.
pub fn device_count() -> usize {
    if !driver_available() {
        return 0;
    }
    CudaContext::device_count().map(|n| n.max(0) as usize).unwrap_or(0)
}

/// Where to run, as a user names it on the command line: `auto`, `cpu`, `cuda` or `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The first CUDA device when one is usable, else the CPU.
    Auto,
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(DeviceSpec::Auto),
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| Error::Input(format!("device `{s}`: expected auto, cpu, cuda or cuda:N"))),
        }
    }
}

impl DeviceSpec {
    /// The GPU this names, or `None` for the CPU. `auto` falls back to the CPU when there is
    /// no driver or no device; an explicit `cuda[:N]` that cannot be opened is an error.
    pub fn open(self) -> Result<Option<Arc<Gpu>>> {
        match self {
            DeviceSpec::Cpu => Ok(None),
            DeviceSpec::Auto if device_count() == 0 => Ok(None),
            DeviceSpec::Auto => Gpu::new(0).map(Some),
            DeviceSpec::Cuda(n) => Gpu::new(n).map(Some),
        }
    }
}

/// One CUDA device: its context, the stream every op of tern is queued on, and the modules
/// compiled for it so far.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    arch: String,
    name: String,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// Page-locked host memory that large downloads pass through (see [`Gpu::download_f32`]).
    staging: Mutex<Option<PinnedHostSlice<f32>>>,
    /// Which kernels are launched as dependent launches (see [`Gpu::launch_builder`]).
    dependent_launch: DependentLaunch,
    /// Whether the launches queued now are a decode step's ([`Gpu::decode_step`]).
    in_decode_step: AtomicBool,
    /// Kernels launched so far, and the count when the last kernel that writes recurrent
    /// states was launched with the states it writes ([`Gpu::note_state_writer`]).
    launches: AtomicU64,
    state_writer: Mutex<(u64, StateRanges)>,
    /// Whether [`Gpu::state_reads_may_lead`] compares the states written and read (the
    /// default) or takes every writer as writing every state (TERN_STATE_RANGES=0, to measure
    /// the two on the same run). H100, Qwen3.5-0.8B bf16 decode of one sequence, two pairs in
    /// one call: 1 080.5 -> 1 102.7 and 1 096.1 -> 1 115.2 tok/s; after 512 tokens 1 037.6 ->
    /// 1 054.2 and 1 040.1 -> 1 069.8 (BENCHMARKS.md, twenty-fourth session).
    state_ranges: bool,
    /// The count when the last kernel that awaits its predecessor before letting the next be
    /// scheduled was launched (every kernel but those launched with
    /// [`KernelLaunch::triggers_early`]).
    ordered_at: AtomicU64,
    /// Whether the one-row GEMVs let the kernel after them be scheduled before they await the
    /// kernel before them, where there is dependent launch ([`Gpu::early_trigger`]).
    early_trigger: bool,
    /// Device tables of addresses by their contents (see [`Gpu::address_table`]).
    tables: Mutex<AddressTables>,
    /// While a step is recorded with its buffers from a pool of its own ([`StepPool`]): that
    /// pool (its handle as an integer) and the stream its allocations are ordered on.
    step_pool: Mutex<Option<(usize, Arc<CudaStream>)>>,
}

/// A memory pool of one recorded step, for the buffers its ops allocate while it is recorded
/// (one sequence's decode steps, unless TERN_STEP_POOL=0; [`Gpu::allocate_from`]), or of every
/// recorded decode round of several sequences (unless TERN_STEP_POOL_ROUNDS=0, `CudaOps`).
///
/// Why: every op allocates its output on the stream and frees buffers as they drop, so a
/// captured step holds a memory node between most pairs of its kernels (a tiny Qwen3.5 decode
/// step: 67 allocations and 67 frees among 63 kernels), and a dependent launch behind a memory
/// node gets a full edge instead of a programmatic one: 41 of those 63 kernels could not start
/// before the kernel before them ended (BENCHMARKS.md, twenty-first session). The driver
/// refuses to remove a memory node's edges after capture, so instead the step's buffers are
/// taken, while it is recorded, from this pool on a second stream that is not captured: the
/// graph then holds no memory nodes (measured on an H100: that step's graph becomes 63 kernels
/// and one copy, with 62 programmatic edges). A buffer freed during the recording returns to
/// this pool at once and may serve a later buffer of the same step, as a graph's own
/// allocations would: safe because the later buffer's kernels come after the earlier one's
/// last kernel on the step's stream, and every kernel awaits the one before it before it
/// touches anything but weights and recurrent states (cuda/launch.cuh). The pool keeps its
/// memory (release threshold at its maximum) and serves nothing else, so the addresses the
/// graph holds stay its own until the graph and the pool are dropped together.
pub struct StepPool {
    pool: usize,
    side: Arc<CudaStream>,
}

// SAFETY: the pool handle is used only through the driver API, which is thread-safe.
unsafe impl Send for StepPool {}
unsafe impl Sync for StepPool {}

impl Drop for StepPool {
    fn drop(&mut self) {
        // SAFETY: the pool is this value's own; the driver defers the release until the
        // pool's last allocation is freed. An error cannot be reported from a drop.
        unsafe { cudarc::driver::sys::cuMemPoolDestroy(self.pool as cudarc::driver::sys::CUmemoryPool) };
    }
}

/// Which launches are programmatic dependent launches (sm_90 and later; TERN_DEPENDENT_LAUNCH
/// chooses). Under it a kernel's blocks start while the kernel before it runs, and the one-row
/// GEMVs request their first weights before they await it (`early`, matmul/gemv.cu). Measured
/// on an H100 (BENCHMARKS.md, 2026-12-05): a recorded Qwen3.5-0.8B decode step 897 -> 923 tok/s
/// with both, 896 with dependent launch alone, and a chain of 96 GEMVs 565 -> 499 µs; but
/// prompts ran slower under it (16 tokens 3 849 -> 3 282 tok/s; an f32-mode prefill 16% on the
/// H200, 2026-12-03), where a kernel's waiting blocks hold multiprocessors that the many
/// blocks of the kernel before it still need. Hence decode steps only, by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DependentLaunch {
    /// TERN_DEPENDENT_LAUNCH=0, and devices before sm_90.
    Never,
    /// The default: the launches of decode steps ([`Gpu::decode_step`]).
    DecodeSteps,
    /// TERN_DEPENDENT_LAUNCH=1: every launch.
    Always,
}

impl DependentLaunch {
    fn from_env(major: i32) -> Self {
        match std::env::var("TERN_DEPENDENT_LAUNCH").as_deref() {
            _ if major < 9 => DependentLaunch::Never,
            Ok("0") => DependentLaunch::Never,
            Ok("1") => DependentLaunch::Always,
            _ => DependentLaunch::DecodeSteps,
        }
    }
}

/// While alive, the GPU's launches are a decode step's ([`Gpu::decode_step`]).
pub struct DecodeStep<'a>(&'a Gpu);

impl Drop for DecodeStep<'_> {
    fn drop(&mut self) {
        self.0.in_decode_step.store(false, Ordering::Relaxed);
    }
}

/// Device copies of small address tables (each sequence's state, each row's KV cache), kept by
/// their contents so that a step recorded as a CUDA graph finds on the device the table its
/// plain first run uploaded (a recording may not copy from the host). Tables handed out while
/// a step is recorded, and any other long-lived buffer a recorded kernel reads or writes (see
/// [`Gpu::hold_while_recorded`]), are also kept in `recorded` until the recorder takes them
/// ([`Gpu::take_recorded_buffers`]) to keep them alive as long as its graph: a graph holds the
/// buffer's address, and clearing a cache or growing a scratch buffer must not free it under a
/// graph that replays later (the graph would then write memory the pool has handed to another
/// buffer).
#[derive(Default)]
struct AddressTables {
    by_contents: HashMap<Vec<u64>, Arc<CudaSlice<u64>>>,
    recorded: Vec<RecordedBuffer>,
}

/// A buffer a recorded graph reads or writes, of any element type, kept alive with the graph.
pub type RecordedBuffer = Arc<dyn std::any::Any + Send + Sync>;

/// Tables kept before the cache is cleared (at a step's start, [`Gpu::trim_address_tables`]): a
/// decode step of a hybrid model needs a few dozen, and the tables of retired sequences are never
/// asked for again.
const ADDRESS_TABLES_KEPT: usize = 4096;
/// Longer tables are uploaded each time and not kept: only steps of few rows are recorded, and a
/// prompt's per-row tables would hold memory they never use again.
const ADDRESS_TABLE_KEPT_LEN: usize = 1024;

/// Downloads of at least this many floats go through the page-locked staging buffer.
const STAGED_MIN: usize = 1 << 16;

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu(cuda:{} {} {})", self.ordinal, self.name, self.arch)
    }
}

impl Gpu {
    /// Opens device `ordinal`. Errors (never panics) without a driver or such a device.
    pub fn new(ordinal: usize) -> Result<Arc<Gpu>> {
        if !driver_available() {
            return Err(Error::Cuda("no CUDA driver: libcuda.so.1 cannot be loaded (no NVIDIA GPU or driver here)".into()));
        }
        let count = CudaContext::device_count().map_err(driver_err("counting devices"))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::Cuda(format!("cuda:{ordinal}: this machine has {count} CUDA device(s)")));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err("creating the context"))?;
        // One stream orders every op, so cudarc's per-buffer event tracking (for several
        // streams) would only add work to each launch.
        // SAFETY: nothing has been allocated on this context yet.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own, not the legacy default stream: only a created stream can be
        // captured into a CUDA graph (the default one answers "operation not permitted when
        // stream is capturing").
        let stream = ctx.new_stream().map_err(driver_err("creating a stream"))?;
        let (major, minor) = ctx.compute_capability().map_err(driver_err("reading the compute capability"))?;
        let name = ctx.name().map_err(driver_err("reading the device name"))?;
        Ok(Arc::new(Gpu {
            ctx,
            stream,
            ordinal,
            arch: nvrtc_arch(major, minor),
            name,
            modules: Mutex::new(HashMap::new()),
            staging: Mutex::new(None),
            dependent_launch: DependentLaunch::from_env(major),
            in_decode_step: AtomicBool::new(false),
            launches: AtomicU64::new(0),
            state_writer: Mutex::new((u64::MAX, Vec::new())),
            ordered_at: AtomicU64::new(0),
            early_trigger: std::env::var("TERN_EARLY_TRIGGER").map_or(true, |v| v != "0"),
            state_ranges: std::env::var("TERN_STATE_RANGES").map_or(true, |v| v != "0"),
            tables: Mutex::new(AddressTables::default()),
            step_pool: Mutex::new(None),
        }))
    }

    /// A device table holding `addresses`, uploaded the first time these contents are asked
    /// for and reused afterwards, recorded steps included (see [`AddressTables`]).
    pub fn address_table(&self, addresses: &[u64]) -> Result<Arc<CudaSlice<u64>>> {
        if addresses.len() > ADDRESS_TABLE_KEPT_LEN {
            return Ok(Arc::new(self.upload(addresses)?));
        }
        let recording = self.recording()?;
        let mut t = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        let table = match t.by_contents.get(addresses) {
            Some(table) => table.clone(),
            None => {
                // A recording finds here every table the step's plain run uploaded just before
                // (nothing clears the cache inside a step); one it cannot find it cannot upload
                // either, and the recording then fails as a whole (see `not_recording`).
                let table = Arc::new(self.upload(addresses)?);
                t.by_contents.insert(addresses.to_vec(), table.clone());
                table
            }
        };
        if recording {
            t.recorded.push(table.clone());
        }
        Ok(table)
    }

    /// Keeps `buffer` alive as long as the graph being recorded now, when a step is being
    /// recorded: for a buffer that outlives a step but may be replaced between steps (a scratch
    /// buffer that grows), whose address a recorded kernel holds.
    pub fn hold_while_recorded<T: Send + Sync + 'static>(&self, buffer: &Arc<T>) -> Result<()> {
        if self.recording()? {
            self.tables.lock().unwrap_or_else(|p| p.into_inner()).recorded.push(buffer.clone());
        }
        Ok(())
    }

    /// Clears the table cache when it has grown past [`ADDRESS_TABLES_KEPT`]: called between
    /// steps, so that a step's plain run and its recording see the same tables. Graphs keep
    /// the tables they read (see [`AddressTables`]).
    pub fn trim_address_tables(&self) {
        let mut t = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        if t.by_contents.len() >= ADDRESS_TABLES_KEPT {
            t.by_contents.clear();
        }
    }

    /// The tables handed out and the buffers held ([`Gpu::hold_while_recorded`]) since the last
    /// call while a step was being recorded: the recorder keeps them as long as its graph.
    pub fn take_recorded_buffers(&self) -> Vec<RecordedBuffer> {
        std::mem::take(&mut self.tables.lock().unwrap_or_else(|p| p.into_inner()).recorded)
    }

    /// Whether the stream is being recorded into a graph now.
    pub fn recording(&self) -> Result<bool> {
        use cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        Ok(self.stream.capture_status().map_err(driver_err("reading the capture status"))? != CU_STREAM_CAPTURE_STATUS_NONE)
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    pub fn arch(&self) -> &str {
        &self.arch
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    /// Whether any kernel is launched as a programmatic dependent launch ([`DependentLaunch`]).
    pub fn dependent_launch(&self) -> bool {
        self.dependent_launch != DependentLaunch::Never
    }

    /// Marks the launches queued until the guard drops as a decode step's, which take dependent
    /// launch by default ([`DependentLaunch::DecodeSteps`]).
    pub fn decode_step(&self) -> DecodeStep<'_> {
        self.in_decode_step.store(true, Ordering::Relaxed);
        DecodeStep(self)
    }

    /// Whether the launches now queued are a decode step's ([`Gpu::decode_step`]).
    pub fn in_decode_step(&self) -> bool {
        self.in_decode_step.load(Ordering::Relaxed)
    }

    /// Records that the kernel just launched writes the recurrent states `written` (the
    /// gated-delta recurrence and the chunked prefill's state pass), for
    /// [`Gpu::state_reads_may_lead`].
    pub fn note_state_writer(&self, written: StateRanges) {
        *self.state_writer.lock().unwrap_or_else(|e| e.into_inner()) = (self.launches.load(Ordering::Relaxed), written);
    }

    /// Whether a kernel launched next may read the recurrent states `read` before it awaits the
    /// kernel before it: it is a dependent launch and no kernel that may still run then writes
    /// any of them (below; every kernel that does calls [`Gpu::note_state_writer`]; copies and fills of
    /// states are not kernels, and a copy on the stream is a full dependency). The count orders
    /// launches as the stream does
    /// because a Gpu's kernels are queued by one thread at a time: every model opens its own
    /// Gpu, and its ops serialise their forward passes (`Ops::serialize`).
    ///
    /// Kernels launched with [`KernelLaunch::triggers_early`] (one-row GEMVs, which write no
    /// state) let the next be scheduled before they await their own predecessor, so a kernel
    /// after a run of them may start while every kernel of the run and the one before the run
    /// still run: that one must write none of the states read. Without such kernels it is the
    /// one before. It may write others (a dense model's decode step: a layer's recurrence, then
    /// products alone up to the next layer's): each layer's states are buffers of their own,
    /// so the next layer's recurrence still reads its own before its wait.
    pub fn state_reads_may_lead(&self, read: &[(u64, u64)]) -> bool {
        let writer = self.state_writer.lock().unwrap_or_else(|e| e.into_inner());
        let (dependent, ordered_at) = (self.launches_dependent(), self.ordered_at.load(Ordering::Relaxed));
        if !self.state_ranges {
            // Every writer taken as writing every state: the rule before ranges were compared.
            return dependent && writer.0 != ordered_at;
        }
        state_reads_may_lead(dependent, writer.0, ordered_at, &writer.1, read)
    }

    /// Whether the one-row GEMVs, whose only reads before their wait are weights, let the
    /// kernel after them be scheduled as they start rather than once they have awaited the
    /// kernel before them (`tern_let_dependents_launch`, launch.cuh): then more than two grids
    /// are in flight, and the weights of several coming products can be requested while a
    /// latency-bound kernel (the recurrence, attention) runs. On by default under dependent
    /// launch; TERN_EARLY_TRIGGER=0 declines, to measure the two on the same run. The same bits
    /// either way. H100, Qwen3.5-0.8B bf16 decode of one sequence, same call: 1 034.6 / 1 032.5
    /// -> 1 059.9 / 1 062.6 tok/s; after 512 tokens 992.7 / 989.5 -> 1 016.2 / 1 016.4
    /// (BENCHMARKS.md, twenty-third session).
    pub fn early_trigger(&self) -> bool {
        self.early_trigger && self.dependent_launch()
    }

    fn launches_dependent(&self) -> bool {
        match self.dependent_launch {
            DependentLaunch::Never => false,
            DependentLaunch::DecodeSteps => self.in_decode_step(),
            DependentLaunch::Always => true,
        }
    }
    /// Whether the device has the warpgroup products (src/kernels/wgmma.cuh): an sm_90 GPU, whose
    /// modules compile for sm_90a ([`nvrtc_arch`]).
    pub fn warpgroup_products(&self) -> bool {
        self.arch == nvrtc_arch(9, 0)
    }

    /// Whether kernels can be launched in thread block clusters (sm_90 and later;
    /// [`KernelLaunch::cluster`]).
    pub fn cluster_launch(&self) -> Result<bool> {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH as CLUSTERS;
        self.ctx.attribute(CLUSTERS).map(|n| n != 0).map_err(driver_err("reading whether clusters can be launched"))
    }

    /// Streaming multiprocessors on the device.
    pub fn multiprocessors(&self) -> Result<usize> {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT as SMS;
        self.ctx.attribute(SMS).map(|n| n as usize).map_err(driver_err("reading the multiprocessor count"))
    }

    /// Function `func` of `source`, compiling (through the disk cache) and loading the module
    /// on first use.
    pub fn function(&self, source: &KernelSource, func: &str) -> Result<CudaFunction> {
        let module = {
            let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
            match modules.get(source.name) {
                Some(m) => m.clone(),
                None => {
                    let code = source_override(source.name)?;
                    let cubin = nvrtc::compile_cached(source.name, code.as_deref().unwrap_or(source.code), &self.arch)?;
                    let m = self
                        .ctx
                        .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                        .map_err(driver_err(&format!("loading module {}", source.name)))?;
                    modules.insert(source.name, m.clone());
                    m
                }
            }
        };
        module.load_function(func).map_err(driver_err(&format!("{}: function {func}", source.name)))
    }

    /// A launch of `func` on the GPU's stream; arguments are added with [`KernelLaunch::arg`]
    /// in the kernel's parameter order, then [`KernelLaunch::launch`] queues it.
    ///
    /// On sm_90 and later, inside a decode step (or everywhere with TERN_DEPENDENT_LAUNCH=1;
    /// [`DependentLaunch`]) the launch is a programmatic dependent launch: the kernel may be
    /// scheduled while the kernel before it on the stream still runs, and waits for it on the
    /// device (every kernel of tern starts with `tern_await_prior_kernel()`, launch.cuh);
    /// recorded graphs keep the relation as programmatic edges. Otherwise a plain launch.
    pub fn launch_builder<'a>(&'a self, func: &'a CudaFunction) -> KernelLaunch<'a> {
        KernelLaunch { gpu: self, func, args: Vec::new(), addresses: Vec::new(), triggers_early: false, cluster: None }
    }

    /// Refuses a copy between host and device while the stream is being recorded into a
    /// graph: the graph would keep the host address and read (or write) it again at every
    /// replay, long after the host buffer is gone. A recording that meets this error fails as
    /// a whole and the step runs plainly instead.
    fn not_recording(&self, what: &str) -> Result<()> {
        match self.recording()? {
            false => Ok(()),
            true => Err(Error::Cuda(format!("{what} inside a recorded step (a graph cannot own a host buffer)"))),
        }
    }

    /// A device copy of `data`.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.not_recording("a copy to the device")?;
        self.stream.clone_htod(data).map_err(driver_err("copying to the device"))
    }

    /// Copies `src` into the existing device buffer `dst` of the same length.
    pub fn write<T: DeviceRepr>(&self, src: &[T], dst: &mut CudaSlice<T>) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::Shape(format!("device write: {} elements into a buffer of {}", src.len(), dst.len())));
        }
        self.not_recording("a copy to the device")?;
        self.stream.memcpy_htod(src, dst).map_err(driver_err("copying to the device"))
    }

    /// A host copy of `buf` (waits for the work queued before it).
    pub fn download<T: DeviceRepr + Default + Clone>(&self, buf: &CudaSlice<T>) -> Result<Vec<T>> {
        self.not_recording("a copy to the host")?;
        self.stream.clone_dtoh(buf).map_err(driver_err("copying from the device"))
    }

    /// [`Gpu::download`] of f32 values. A large one (a decode step's logits) goes through a
    /// page-locked buffer kept for the next: the driver copies pageable memory through a
    /// staging buffer of its own in pieces, several times slower than a direct copy into
    /// page-locked memory. Where page-locked memory cannot be had, the plain download.
    pub fn download_f32(&self, buf: &CudaSlice<f32>) -> Result<Vec<f32>> {
        self.read_f32(buf, |host| host.to_vec())
    }

    /// `read` over a host copy of `buf`, made as [`Gpu::download_f32`] makes it: a caller that
    /// turns the values into something else (a decode step's logits into one row a sequence)
    /// copies them once, from the staging buffer.
    pub fn read_f32<T>(&self, buf: &CudaSlice<f32>, read: impl FnOnce(&[f32]) -> T) -> Result<T> {
        if buf.len() >= STAGED_MIN {
            // `read` comes back unused when page-locked memory cannot be had.
            match self.staged(buf, read)? {
                Ok(v) => return Ok(v),
                Err(read) => return Ok(read(&self.download(buf)?)),
            }
        }
        Ok(read(&self.download(buf)?))
    }

    /// `read` over a host copy of `buf` made through the page-locked staging buffer; `read`
    /// itself back, unused, when page-locked memory cannot be had.
    fn staged<T, F: FnOnce(&[f32]) -> T>(&self, buf: &CudaSlice<f32>, read: F) -> Result<std::result::Result<T, F>> {
        let n = buf.len();
        self.not_recording("a copy to the host")?;
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if staging.as_ref().is_none_or(|s| s.len() < n) {
            *staging = None;
            // SAFETY: the buffer is written by the copy below before it is read.
            match unsafe { self.ctx.alloc_pinned_with_flags::<f32>(n, 0) } {
                Ok(s) => *staging = Some(s),
                Err(_) => return Ok(Err(read)),
            }
        }
        let host = staging.as_mut().expect("allocated above").as_mut_slice().map_err(driver_err("waiting for the staging buffer"))?;
        let host = &mut host[..n];
        // SAFETY: `host` holds exactly n floats, the device buffer n; the stream orders the copy
        // after the work that writes `buf`, and the synchronize below waits for it.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(host, self.ptr(buf), self.stream.cu_stream()) }
            .map_err(driver_err("copying from the device"))?;
        self.synchronize()?;
        Ok(Ok(read(host)))
    }

    /// The device address of `buf`, for a kernel argument that may be null (see [`Gpu::ptr_opt`]).
    /// Event tracking is off (one stream), so the returned guard has nothing to record.
    pub fn ptr<T>(&self, buf: &CudaSlice<T>) -> u64 {
        use cudarc::driver::DevicePtr;
        buf.device_ptr(&self.stream).0
    }

    /// [`Gpu::ptr`], or 0 (a null pointer the kernel tests for).
    pub fn ptr_opt<T>(&self, buf: Option<&CudaSlice<T>>) -> u64 {
        buf.map_or(0, |b| self.ptr(b))
    }

    /// A device buffer of `n` elements whose contents are undefined until a kernel writes them
    /// (every caller writes all of it before reading).
    pub fn alloc<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        if let Some((pool, side)) = self.pooled() {
            let bytes = (n * std::mem::size_of::<T>()).max(1);
            let mut ptr: cudarc::driver::sys::CUdeviceptr = 0;
            // SAFETY: the pool is live (the recorder holds it while it is set) and the side
            // stream is this context's; the slice then frees the buffer on that stream, back
            // to the pool.
            unsafe {
                cudarc::driver::sys::cuMemAllocFromPoolAsync(&mut ptr, bytes, pool as cudarc::driver::sys::CUmemoryPool, side.cu_stream())
                    .result()
                    .map_err(driver_err(&format!("allocating {n} elements from a step's pool")))?;
                return Ok(side.upgrade_device_ptr(ptr, n));
            }
        }
        // SAFETY: the buffer is only handed to kernels that overwrite it before anything reads it.
        unsafe { self.stream.alloc::<T>(n) }.map_err(driver_err(&format!("allocating {n} elements")))
    }

    /// A zeroed device buffer of `n` elements (zeroed on the stream, so a recorded step zeroes
    /// it at every replay).
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        if self.pooled().is_some() {
            let mut buf = self.alloc::<T>(n)?;
            self.fill_bytes(&mut buf, 0)?;
            return Ok(buf);
        }
        self.stream.alloc_zeros(n).map_err(driver_err(&format!("allocating {n} elements")))
    }

    /// The step pool [`Gpu::alloc`] takes buffers from now, and its stream ([`Gpu::allocate_from`]).
    fn pooled(&self) -> Option<(usize, Arc<CudaStream>)> {
        self.step_pool.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Sets every byte of `buf` to `byte`, queued on the stream.
    fn fill_bytes<T>(&self, buf: &mut CudaSlice<T>, byte: u8) -> Result<()> {
        let bytes = buf.len() * std::mem::size_of::<T>();
        // SAFETY: the range is the buffer's own bytes; the stream orders the fill.
        unsafe { cudarc::driver::result::memset_d8_async(self.ptr(buf), byte, bytes, self.stream.cu_stream()) }
            .map_err(driver_err("filling a device buffer"))
    }

    /// A memory pool for one recorded step's buffers ([`StepPool`]). Errors where the driver
    /// has no pools of one's own: the step is then recorded as captured.
    pub fn step_pool(&self) -> Result<StepPool> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread().map_err(driver_err("binding the context"))?;
        // The stream first: once the pool exists, only its StepPool may return early (and
        // destroy it).
        let side = self.ctx.new_stream().map_err(driver_err("creating a stream"))?;
        // SAFETY: zeroed properties are valid once type and location are set; the pool is
        // destroyed by the StepPool that owns it.
        unsafe {
            let mut props: sys::CUmemPoolProps = std::mem::zeroed();
            props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            props.location.id = self.ordinal as i32;
            let pool = cudarc::driver::result::mem_pool::create(&props).map_err(driver_err("creating a step's memory pool"))?;
            let owned = StepPool { pool: pool as usize, side };
            let mut keep = u64::MAX;
            sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut keep as *mut u64 as *mut std::ffi::c_void)
                .result()
                .map_err(driver_err("keeping a step's memory pool"))?;
            Ok(owned)
        }
    }

    /// Takes the buffers of [`Gpu::alloc`] and [`Gpu::zeros`] from `pool` until called again
    /// with None (while a step is recorded, [`StepPool`]).
    pub fn allocate_from(&self, pool: Option<&StepPool>) {
        *self.step_pool.lock().unwrap_or_else(|p| p.into_inner()) = pool.map(|p| (p.pool, p.side.clone()));
    }

    /// Fills `buf` with 0xff bytes (NaN as f32, u32::MAX as u32): outputs a kernel must
    /// overwrite, so that one it leaves unwritten is seen.
    pub fn poison<T: DeviceRepr>(&self, buf: &mut CudaSlice<T>) -> Result<()> {
        self.fill_bytes(buf, 0xff)
    }

    /// Device-to-device copy of `src` into `dst` (same length), queued on the stream.
    pub fn copy<T: DeviceRepr>(&self, src: &CudaSlice<T>, dst: &mut CudaSlice<T>) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::Shape(format!("device copy: {} elements into a buffer of {}", src.len(), dst.len())));
        }
        self.stream.memcpy_dtod(src, dst).map_err(driver_err("copying on the device"))
    }

    /// Device-to-device copy of `n` elements from `src[src_at..]` to `dst[dst_at..]`.
    pub fn copy_range<T: DeviceRepr>(&self, src: &CudaSlice<T>, src_at: usize, dst: &mut CudaSlice<T>, dst_at: usize, n: usize) -> Result<()> {
        if src_at + n > src.len() || dst_at + n > dst.len() {
            return Err(Error::Shape(format!(
                "device copy of {n} elements from {src_at} of {} to {dst_at} of {}",
                src.len(),
                dst.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let from = src.slice(src_at..src_at + n);
        let mut to = dst.slice_mut(dst_at..dst_at + n);
        self.stream.memcpy_dtod(&from, &mut to).map_err(driver_err("copying on the device"))
    }

    /// A timing event (timing enabled).
    pub fn event(&self) -> Result<CudaEvent> {
        self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(driver_err("creating an event"))
    }

    /// Waits for every queued op, surfacing asynchronous kernel faults as errors.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_err("synchronizing"))
    }
}

/// What a recorded graph holds ([`graph_summary`]): its nodes by type ("kernel", "mem_alloc",
/// ...) and its edges by (source type, target type, dependency type, source port), e.g.
/// "kernel->kernel:type1port1" for a kernel that follows a kernel through a programmatic edge
/// (dependency type 1) rather than a full one (0).
#[derive(Debug, Default)]
pub struct GraphSummary {
    pub nodes: std::collections::BTreeMap<String, usize>,
    pub edges: std::collections::BTreeMap<String, usize>,
}

impl std::fmt::Display for GraphSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "nodes {:?}; edges {:?}", self.nodes, self.edges)
    }
}

/// [`graph_summary`] as text, for TERN_GRAPH_STATS=1 (a diagnostic): what else (memory
/// allocations and frees, memsets, copies) stands between kernels. Errors read as text.
pub fn graph_stats(graph: cudarc::driver::sys::CUgraph) -> String {
    match graph_summary(graph) {
        Ok(s) => s.to_string(),
        Err(e) => e,
    }
}

/// The nodes and edges of a recorded graph ([`GraphSummary`]); an error names the query that
/// failed.
pub fn graph_summary(graph: cudarc::driver::sys::CUgraph) -> std::result::Result<GraphSummary, String> {
    use cudarc::driver::sys;
    use std::collections::BTreeMap;
    // SAFETY: `graph` is a live graph; each query is first asked for its count, then given
    // buffers of that many entries.
    unsafe {
        let mut n = 0usize;
        if sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) != sys::CUresult::CUDA_SUCCESS {
            return Err("cuGraphGetNodes failed".into());
        }
        let mut nodes = vec![std::ptr::null_mut(); n];
        if sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) != sys::CUresult::CUDA_SUCCESS {
            return Err("cuGraphGetNodes failed".into());
        }
        let kind = |node: sys::CUgraphNode| {
            let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            sys::cuGraphNodeGetType(node, &mut t);
            format!("{t:?}").trim_start_matches("CU_GRAPH_NODE_TYPE_").to_lowercase()
        };
        let mut by_type = BTreeMap::new();
        for &node in &nodes {
            *by_type.entry(kind(node)).or_insert(0usize) += 1;
        }
        let mut e = 0usize;
        if sys::cuGraphGetEdges_v2(graph, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), &mut e) != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("nodes {by_type:?}; cuGraphGetEdges_v2 failed"));
        }
        let (mut from, mut to) = (vec![std::ptr::null_mut(); e], vec![std::ptr::null_mut(); e]);
        let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); e];
        if sys::cuGraphGetEdges_v2(graph, from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr(), &mut e) != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("nodes {by_type:?}; cuGraphGetEdges_v2 failed"));
        }
        let mut edges = BTreeMap::new();
        for i in 0..e {
            *edges.entry(format!("{}->{}:type{}port{}", kind(from[i]), kind(to[i]), data[i].type_, data[i].from_port)).or_insert(0usize) += 1;
        }
        Ok(GraphSummary { nodes: by_type, edges })
    }
}

/// A kernel launch being assembled (see [`Gpu::launch_builder`]). cudarc's own builder has no
/// way to pass launch attributes, hence this one: arguments are borrowed, like cudarc's, so
/// they live until the launch call has copied them.
pub struct KernelLaunch<'a> {
    gpu: &'a Gpu,
    func: &'a CudaFunction,
    args: Vec<*mut std::ffi::c_void>,
    /// Device addresses of buffer arguments, boxed so that `args` can point at them (a Vec of
    /// plain u64 would move them when it grows).
    #[allow(clippy::vec_box)]
    addresses: Vec<Box<u64>>,
    /// Whether the kernel lets the next be scheduled before it awaits the one before it
    /// (`tern_let_dependents_launch`; [`Gpu::state_reads_may_lead`] counts these).
    triggers_early: bool,
    /// Blocks per thread block cluster in x, y, z, or None for no clusters.
    cluster: Option<(u32, u32, u32)>,
}

impl<'a> KernelLaunch<'a> {
    /// Marks the kernel as one that lets the next be scheduled before it awaits the kernel
    /// before it (`tern_let_dependents_launch`, launch.cuh): a one-row GEMV launched with
    /// `early` = 2. Only kernels that write no delta-rule state may be so marked (the states
    /// the recurrence reads before its wait; the conv GEMVs' histories are read after one).
    pub fn triggers_early(&mut self, on: bool) -> &mut Self {
        self.triggers_early = on;
        self
    }

    /// Launches the grid in clusters of x × y × z blocks (the grid a whole number of them; only
    /// where [`Gpu::cluster_launch`] holds).
    pub fn cluster(&mut self, dims: (u32, u32, u32)) -> &mut Self {
        self.cluster = Some(dims);
        self
    }

    /// Adds the next kernel argument: a plain value of the parameter's C type (device
    /// addresses as u64, see [`Gpu::ptr`]).
    pub fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args.push(value as *const T as *mut std::ffi::c_void);
        self
    }

    /// Adds a buffer argument: its device address.
    pub fn buf<T>(&mut self, buffer: &CudaSlice<T>) -> &mut Self {
        let address = Box::new(self.gpu.ptr(buffer));
        self.args.push(&*address as *const u64 as *mut std::ffi::c_void);
        self.addresses.push(address);
        self
    }

    /// Queues the kernel on the GPU's stream.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and every
    /// buffer the kernel reads or writes must hold what the configuration makes it touch.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> std::result::Result<(), DriverError> {
        use cudarc::driver::sys;
        self.gpu.ctx.bind_to_thread()?;
        // SAFETY: a zeroed attribute is a valid "ignore" value; each id is set together with its
        // union member.
        let mut attrs: [sys::CUlaunchAttribute; 2] = [std::mem::zeroed(), std::mem::zeroed()];
        let mut n_attrs = 0;
        if self.gpu.launches_dependent() {
            attrs[n_attrs].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n_attrs].value.programmaticStreamSerializationAllowed = 1;
            n_attrs += 1;
        }
        if let Some((x, y, z)) = self.cluster {
            attrs[n_attrs].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n_attrs].value.clusterDim.x = x;
            attrs[n_attrs].value.clusterDim.y = y;
            attrs[n_attrs].value.clusterDim.z = z;
            n_attrs += 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.gpu.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: n_attrs as std::ffi::c_uint,
        };
        // SAFETY: the caller vouches for the arguments (see above); `args` points at values
        // borrowed for 'a, alive during the call, which copies them.
        let launched = sys::cuLaunchKernelEx(&config, self.func.cu_function(), self.args.as_mut_ptr(), std::ptr::null_mut()).result();
        let count = self.gpu.launches.fetch_add(1, Ordering::Relaxed) + 1;
        if !self.triggers_early {
            self.gpu.ordered_at.store(count, Ordering::Relaxed);
        }
        launched
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse() {
        assert_eq!("auto".parse::<DeviceSpec>().unwrap(), DeviceSpec::Auto);
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        assert_eq!("cuda:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(3));
        for bad in ["gpu", "cuda:", "cuda:x", "CUDA"] {
            assert!(matches!(bad.parse::<DeviceSpec>(), Err(Error::Input(_))), "{bad}");
        }
    }

    /// Without a driver, `auto` is the CPU and an explicit `cuda` is an error, never a panic.
    #[test]
    fn no_driver_means_cpu_or_a_clear_error() {
        if driver_available() {
            return; // a GPU machine: covered by the device tests
        }
        assert!(DeviceSpec::Auto.open().unwrap().is_none());
        assert!(DeviceSpec::Cpu.open().unwrap().is_none());
        match DeviceSpec::Cuda(0).open() {
            Err(Error::Cuda(msg)) => assert!(msg.contains("libcuda"), "{msg}"),
            other => panic!("expected a CUDA error, got {other:?}"),
        }
    }

    /// TERN_CUDA_SOURCE_DIR: a module with a file there takes its text, one without keeps the
    /// built-in source, and a file that cannot be read is an error naming it.
    #[test]
    fn source_dir_overrides_only_the_modules_it_holds() {
        let dir = std::env::temp_dir().join(format!("tern-source-override-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("tern_unreadable.cu")).unwrap();
        std::fs::write(dir.join("tern_matmul.cu"), "// a variant").unwrap();
        assert_eq!(source_override_in(None, "tern_matmul").unwrap(), None);
        assert_eq!(source_override_in(Some(&dir), "tern_matmul").unwrap().as_deref(), Some("// a variant"));
        assert_eq!(source_override_in(Some(&dir), "tern_norm").unwrap(), None);
        let err = source_override_in(Some(&dir), "tern_unreadable").unwrap_err();
        assert!(format!("{err}").contains("tern_unreadable.cu"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// CI check: every CUDA source of the op set compiles with NVRTC for sm_90a (what an H100
    /// or H200 compiles them for: `nvrtc_arch`). It needs NVRTC
    /// (scripts/test.sh installs it and sets LD_LIBRARY_PATH); without it this test FAILS, so a
    /// missing compiler can never pass for a compiled kernel.
    #[test]
    fn every_cuda_source_compiles_for_sm_90() {
        if let Err(e) = nvrtc::available() {
            panic!(
                "{e}\nThis check needs NVRTC: run scripts/test.sh, which installs the nvidia-cuda-nvrtc \
                 wheel into ~/.cache/tern/nvrtc and sets LD_LIBRARY_PATH"
            );
        }
        let (major, minor) = nvrtc::version().unwrap();
        let sources = sources();
        assert!(!sources.is_empty());
        for src in &sources {
            let cubin = nvrtc::compile(src.name, src.code, &nvrtc_arch(9, 0)).unwrap_or_else(|e| panic!("{e}"));
            // An ELF image: what the driver loads.
            assert_eq!(&cubin[..4], b"\x7fELF", "{}", src.name);
            // For reading register counts and SASS without a GPU (cuobjdump -res-usage, nvdisasm).
            if let Some(dir) = std::env::var_os("TERN_CUBIN_DUMP") {
                std::fs::write(std::path::Path::new(&dir).join(format!("{}.cubin", src.name)), &cubin).unwrap();
            }
            eprintln!("nvrtc {major}.{minor}: {} -> {} bytes of sm_90a CUBIN", src.name, cubin.len());
        }
    }

    /// Each kernel's register count in a CUBIN: the EIATTR_REGCOUNT entries (symbol index,
    /// registers) of its `.nv.info` section, named through `.symtab`. An ELF64 image as NVRTC
    /// writes it; `None` where it is not one.
    fn cubin_register_counts(cubin: &[u8]) -> Option<HashMap<String, u32>> {
        let u16_at = |o: usize| cubin.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
        let u32_at = |o: usize| cubin.get(o..o + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()));
        let u64_at = |o: usize| cubin.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize);
        let cstr = |o: usize| cubin.get(o..).and_then(|s| s.split(|&c| c == 0).next()).map(|s| String::from_utf8_lossy(s).into_owned());
        let (shoff, shentsize, shnum, shstrndx) = (u64_at(0x28)?, u16_at(0x3a)?, u16_at(0x3c)?, u16_at(0x3e)?);
        // (name offset, type, file offset, size, link) of each section.
        let sections: Vec<(usize, u32, usize, usize, usize)> = (0..shnum)
            .map(|i| {
                let h = shoff + i * shentsize;
                Some((u32_at(h)? as usize, u32_at(h + 4)?, u64_at(h + 0x18)?, u64_at(h + 0x20)?, u32_at(h + 0x28)? as usize))
            })
            .collect::<Option<_>>()?;
        let names_at = sections.get(shstrndx)?.2;
        let symtab = sections.iter().find(|s| s.1 == 2)?;
        let strtab = sections.get(symtab.4)?;
        let symbol = |i: usize| cstr(strtab.2 + u32_at(symtab.2 + 24 * i)? as usize);
        let info = sections.iter().find(|s| cstr(names_at + s.0).as_deref() == Some(".nv.info"))?;
        let mut counts = HashMap::new();
        let (mut at, end) = (info.2, info.2 + info.3);
        // Attributes: a format byte, an attribute byte, then by format nothing (1), two bytes
        // (2, 3) or a 16-bit size and that many bytes (4).
        while at < end {
            let (format, attribute) = (*cubin.get(at)?, *cubin.get(at + 1)?);
            match format {
                1 => at += 2,
                2 | 3 => at += 4,
                4 => {
                    let size = u16_at(at + 2)?;
                    if attribute == 0x2f {
                        counts.insert(symbol(u32_at(at + 4)? as usize)?, u32_at(at + 8)?);
                    }
                    at += 4 + size;
                }
                _ => return None,
            }
        }
        Some(counts)
    }

    /// CI check: a decode step's one-row GEMVs and its fused gated-delta step keep the registers
    /// they were timed with (sm_90, NVRTC 13.0). Registers are a kernel's worst point's: a path
    /// compiled into a shared device function costs every kernel built from it, whether it takes
    /// the path or not (BENCHMARKS.md, nineteenth session: a normed input's path took the plain
    /// bf16 GEMV from 32 registers to 70 and every one-row product ran ~10% slower; no runtime
    /// test saw it; twenty-fourth session: 32 -> 48 cost 7% of a decode step, as the plain one
    /// is the vocabulary head's, which needs every warp a multiprocessor holds, so it is held
    /// to its 32). Fails without NVRTC, as the compile check does.
    #[test]
    fn decode_kernels_keep_their_registers() {
        if let Err(e) = nvrtc::available() {
            panic!("{e}\nThis check needs NVRTC: run scripts/test.sh (see every_cuda_source_compiles_for_sm_90)");
        }
        let bounds: [(&KernelSource, &[(&str, u32)]); 2] = [
            (
                &crate::kernels::matmul::cuda::SOURCE,
                &[
                    ("tern_gemv_bf16_1", 32),
                    ("tern_gemv_silu_bf16_1", 64),
                    ("tern_gemv_res_bf16_1", 56),
                    ("tern_gemv_conv_bf16_1_k4", 56),
                    ("tern_gemv_q8_1", 48),
                    ("tern_gemv_q8_1x2", 80),
                    ("tern_gemv_silu_bf16_1_normed", 64),
                    ("tern_gemv_bf16_1_normed", 64),
                    ("tern_gemv_conv_bf16_1_k4_normed", 64),
                ],
            ),
            (&crate::kernels::gated_delta::cuda::RECURRENCE, &[("tern_gdn_recurrence_fused_dk128_s_b64", 64)]),
        ];
        for (src, kernels) in bounds {
            let cubin = nvrtc::compile_cached(src.name, src.code, &nvrtc_arch(9, 0)).unwrap_or_else(|e| panic!("{e}"));
            let counts = cubin_register_counts(&cubin).unwrap_or_else(|| panic!("{}: no register counts read from its CUBIN", src.name));
            for &(kernel, most) in kernels {
                let regs = *counts.get(kernel).unwrap_or_else(|| panic!("{}: no register count for {kernel}", src.name));
                eprintln!("{kernel}: {regs} registers (at most {most})");
                assert!(regs <= most, "{kernel} takes {regs} registers, more than the {most} it was timed with");
            }
        }
    }

    /// States may be read before the wait only where no kernel that can still run writes
    /// them: the last launch, or the last ordered one before a run of early-triggering GEMVs.
    #[test]
    fn state_reads_lead_only_past_every_running_writer() {
        // Launches 1..=5: 3 writes states A and is ordered; 4 and 5 trigger early.
        let (a, b): (&[(u64, u64)], &[(u64, u64)]) = (&[(0x1000, 0x2000), (0x8000, 0x9000)], &[(0x2000, 0x3000)]);
        assert!(!state_reads_may_lead(true, 3, 3, a, a), "writer of the same states last among the ordered (4 and 5 early)");
        assert!(!state_reads_may_lead(true, 3, 3, a, &[(0x1fff, 0x2001)]), "a read overlapping a written range by one byte");
        assert!(!state_reads_may_lead(true, 3, 3, a, &[(0x4000, 0x5000), (0x8ff0, 0x9010)]), "one read range of several overlapping");
        assert!(state_reads_may_lead(true, 3, 3, a, b), "writer last among the ordered, other states (the next layer's)");
        assert!(!state_reads_may_lead(true, 5, 5, a, a), "writer just launched");
        assert!(state_reads_may_lead(true, 5, 5, b, a), "writer of other states just launched");
        assert!(state_reads_may_lead(true, 3, 4, a, a), "an ordered kernel after the writer");
        assert!(state_reads_may_lead(true, u64::MAX, 0, &[], a), "no writer yet");
        assert!(!state_reads_may_lead(false, 3, 4, a, b), "plain launches: the wait comes first anyway");
    }

    /// The rule that makes dependent launches safe (launch.cuh): the first statement of every
    /// kernel waits for the kernel before it. A kernel without it could read its inputs before
    /// they are written, so a new kernel that forgets it fails here, on any machine.
    #[test]
    fn every_kernel_awaits_the_prior_kernel() {
        let mut kernels = 0;
        for src in sources() {
            let mut rest = src.code;
            while let Some(at) = rest.find("__global__") {
                let body = &rest[at..];
                let open = body.find('{').unwrap_or_else(|| panic!("{}: a kernel without a body", src.name));
                let first = body[open + 1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
                let head = &body[..open];
                // tern_await_prior_kernel_unless: the GEMVs that may request their weights first
                // and the recurrence its states (launch.cuh), which then await the prior kernel
                // themselves.
                let early = [("tern_matmul", "tern_await_prior_kernel_unless(tern_gemv_early<"), ("tern_gdn_recurrence", "tern_await_prior_kernel_unless(tern_gdn_early_state(a));")];
                let awaits = first.starts_with("tern_await_prior_kernel();") || early.iter().any(|(name, call)| src.name == *name && first.starts_with(call));
                assert!(awaits, "{}: kernel `{}` does not start with tern_await_prior_kernel()", src.name, head.trim());
                kernels += 1;
                rest = &body[open..];
            }
        }
        assert!(kernels >= 40, "only {kernels} kernels found");
    }

    /// The cache returns the compiled CUBIN on a second call and treats a damaged file as a miss.
    #[test]
    fn nvrtc_cache_hits_and_survives_damage() {
        if nvrtc::available().is_err() {
            panic!("NVRTC missing: see every_cuda_source_compiles_for_sm_90");
        }
        let dir = std::env::temp_dir().join(format!("tern-nvrtc-cache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let src = "extern \"C\" __global__ void tern_cache_probe(float* x) { x[threadIdx.x] *= 2.0f; }";
        let a = nvrtc::compile_cached_in(&dir, "tern_cache_probe", src, "sm_90").unwrap();
        let files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(files.len(), 1, "{files:?}");
        let b = nvrtc::compile_cached_in(&dir, "tern_cache_probe", src, "sm_90").unwrap();
        assert_eq!(a, b);
        std::fs::write(&files[0], b"garbage").unwrap();
        let c = nvrtc::compile_cached_in(&dir, "tern_cache_probe", src, "sm_90").unwrap();
        assert_eq!(a, c);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
