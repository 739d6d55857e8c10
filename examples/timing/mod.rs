//! Timing for the benchmark examples (gdn_bench, gemv_bench, gemv_chain_bench): CUDA events
//! around stream work, and CUDA graphs recorded once and replayed, as a decode step runs.
//! Each example compiles this module on its own and uses only part of it.
#![allow(dead_code)]

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use tern::cuda::Gpu;
use tern::Result;

/// A driver error as tern's error.
pub fn err(e: impl std::fmt::Debug) -> tern::Error {
    tern::Error::Cuda(format!("{e:?}"))
}

/// Median milliseconds of `reps` timed runs of `f` (after `warm` untimed ones), by events; `f`
/// gets the run's index, the untimed runs counted.
pub fn time_ms(gpu: &Gpu, warm: usize, reps: usize, mut f: impl FnMut(usize) -> Result<()>) -> Result<f64> {
    let (start, end) = (gpu.event()?, gpu.event()?);
    for i in 0..warm {
        f(i)?;
    }
    gpu.synchronize()?;
    let mut times = Vec::with_capacity(reps);
    for i in 0..reps {
        start.record(gpu.stream()).map_err(err)?;
        f(warm + i)?;
        end.record(gpu.stream()).map_err(err)?;
        end.synchronize().map_err(err)?;
        times.push(start.elapsed_ms(&end).map_err(err)? as f64);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[reps / 2])
}

/// What `f` queues on the stream, recorded into a graph (not run). Whatever `f` does, the
/// capture ends, or the stream would stay in it; an error of `f` or of the capture is returned.
pub fn record_graph(gpu: &Gpu, f: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
    let stream = gpu.stream();
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(err)?;
    let queued = f();
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(err);
    match (queued, graph) {
        (Ok(()), Ok(Some(g))) => Ok(g),
        (q, g) => Err(err(format!("no graph recorded: {:?} / {:?}", q.err(), g.err()))),
    }
}

/// `f` recorded once into a graph, then the median milliseconds of `reps` replays (after two
/// untimed ones), as [`time_ms`] times them.
pub fn time_graph_ms(gpu: &Gpu, reps: usize, f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let graph = record_graph(gpu, f)?;
    time_ms(gpu, 2, reps, |_| graph.launch().map_err(err))
}
