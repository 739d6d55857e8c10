//! A step recorded as a CUDA graph, with its memory nodes taken out of the chain of kernels.
//!
//! Why: every op allocates its output on the stream (cudarc's stream-ordered allocation) and
//! frees its inputs' buffers as they drop, so a captured decode step is a chain in which most
//! kernels are separated by memory nodes: kernel → mem_alloc → kernel, kernel → mem_free →
//! mem_alloc → kernel. A kernel launched as a programmatic dependent launch gets its
//! programmatic edge only from a kernel right before it in the stream; behind a memory node its
//! edge is a full one, so it cannot start until the kernel before it has ended (no early
//! weights, no overlap of its launch with that kernel's tail). Measured on an H100 (a tiny
//! Qwen3.5 model's decode step, TERN_GRAPH_STATS=1): 63 kernels, 67 allocations, 67 frees, and
//! only 22 kernel → kernel programmatic edges; 41 kernels waited behind memory nodes.
//!
//! The contraction rewires the captured graph before it is instantiated:
//! - allocation nodes depend on nothing (they do no work on the device; each allocation then
//!   gets memory of its own within the graph instead of memory freed earlier in the step,
//!   a few MB for a decode step);
//! - a free node depends on the work nodes (and allocations) it followed through any chain of
//!   memory nodes, so it still comes after every use of its buffer, and nothing depends on it;
//! - any other node depends on the work nodes it followed through chains of memory nodes, and
//!   on the allocations in those chains (so each buffer is allocated before its first use).
//!   Between two kernels of a dependent step the edge is programmatic, as a capture makes it for
//!   two kernels next to each other in the stream (tern's kernels await the prior kernel before
//!   they touch anything it writes: cuda/launch.cuh).
//!
//! Where the driver cannot list a graph's nodes and edges (an emulator), the graph is kept as
//! captured.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys;

use crate::cuda::{driver_err, CudaStream};
use crate::error::{Error, Result};

/// A recorded step: the graph and its executable instance, launched on `stream`.
pub struct StepGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    stream: Arc<CudaStream>,
}

// SAFETY: the handles are used only through the driver API, which is thread-safe; tern queues
// a GPU's work from one thread at a time (CudaOps serializes its ops).
unsafe impl Send for StepGraph {}
unsafe impl Sync for StepGraph {}

impl Drop for StepGraph {
    fn drop(&mut self) {
        // SAFETY: both handles are this value's own, destroyed once. Errors cannot be reported
        // from a drop; a failed destroy leaks the graph.
        unsafe {
            sys::cuGraphExecDestroy(self.exec);
            sys::cuGraphDestroy(self.graph);
        }
    }
}

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("{what}: {r:?}")))
    }
}

impl StepGraph {
    /// Ends the capture on `stream` and instantiates what it recorded (None: nothing was), its
    /// memory nodes contracted out of the chain first where `contract` (see the module note);
    /// `programmatic`: the step's kernels were dependent launches.
    pub fn end_capture(stream: &Arc<CudaStream>, contract: bool, programmatic: bool) -> Result<Option<StepGraph>> {
        stream.context().bind_to_thread().map_err(driver_err("binding the context"))?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is capturing (the caller began it); `graph` receives the result.
        check("ending a graph capture", unsafe { sys::cuStreamEndCapture(stream.cu_stream(), &mut graph) })?;
        if graph.is_null() {
            return Ok(None);
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` is the live graph just captured; it is rewired only through the
        // driver's own edge calls, then instantiated into `exec`. On failure it is destroyed.
        let instantiated = unsafe {
            (if contract { contract_memory_nodes(graph, programmatic) } else { Ok(()) })
                .and_then(|()| check("instantiating a recorded step", sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)))
        };
        if let Err(e) = instantiated {
            // SAFETY: the graph is ours and not instantiated.
            unsafe { sys::cuGraphDestroy(graph) };
            return Err(e);
        }
        Ok(Some(StepGraph { graph, exec, stream: stream.clone() }))
    }

    /// Queues one replay on the stream.
    pub fn launch(&self) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(driver_err("binding the context"))?;
        // SAFETY: the executable graph is live; its buffers are kept alive by the recorder.
        check("launching a recorded step", unsafe { sys::cuGraphLaunch(self.exec, self.stream.cu_stream()) })
    }

    /// The graph's handle (for [`graph_stats`](crate::cuda::graph_stats)).
    pub fn cu_graph(&self) -> sys::CUgraph {
        self.graph
    }
}

/// The graph's nodes (None where the driver does not list them).
unsafe fn nodes_of(graph: sys::CUgraph) -> Option<Vec<sys::CUgraphNode>> {
    let mut n = 0usize;
    if sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    let mut nodes = vec![std::ptr::null_mut(); n];
    if sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    nodes.truncate(n);
    Some(nodes)
}

/// See the module note. Leaves the graph as captured where the driver cannot list it.
unsafe fn contract_memory_nodes(graph: sys::CUgraph, programmatic: bool) -> Result<()> {
    use sys::CUgraphNodeType::{CU_GRAPH_NODE_TYPE_KERNEL as KERNEL, CU_GRAPH_NODE_TYPE_MEM_ALLOC as ALLOC, CU_GRAPH_NODE_TYPE_MEM_FREE as FREE};
    let Some(nodes) = nodes_of(graph) else { return Ok(()) };
    let mut kinds = Vec::with_capacity(nodes.len());
    for &node in &nodes {
        let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        check("reading a graph node's type", sys::cuGraphNodeGetType(node, &mut t))?;
        kinds.push(t);
    }
    if !kinds.iter().any(|&k| k == ALLOC || k == FREE) {
        return Ok(());
    }
    let at: HashMap<sys::CUgraphNode, usize> = nodes.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let mut e = 0usize;
    check("listing a graph's edges", sys::cuGraphGetEdges_v2(graph, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), &mut e))?;
    let (mut from, mut to) = (vec![std::ptr::null_mut(); e], vec![std::ptr::null_mut(); e]);
    let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); e];
    check("listing a graph's edges", sys::cuGraphGetEdges_v2(graph, from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr(), &mut e))?;
    let mut preds: Vec<Vec<(usize, sys::CUgraphEdgeData)>> = vec![Vec::new(); nodes.len()];
    for i in 0..e {
        preds[at[&to[i]]].push((at[&from[i]], data[i]));
    }
    let memory = |i: usize| kinds[i] == ALLOC || kinds[i] == FREE;
    let full: sys::CUgraphEdgeData = std::mem::zeroed();
    let mut edge_after_kernel = full;
    edge_after_kernel.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
    edge_after_kernel.type_ = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;

    // Each node's new predecessors, by node, with the edge's data (a programmatic edge where
    // two kernels of a dependent step meet).
    let mut new_preds: Vec<Vec<(usize, sys::CUgraphEdgeData)>> = vec![Vec::new(); nodes.len()];
    for w in 0..nodes.len() {
        if kinds[w] == ALLOC {
            continue;
        }
        let mut chosen: HashMap<usize, sys::CUgraphEdgeData> = HashMap::new();
        let mut add = |p: usize, d: sys::CUgraphEdgeData| {
            let entry = chosen.entry(p).or_insert(d);
            if d.type_ != 0 {
                *entry = d;
            }
        };
        // Direct predecessors that are work nodes keep their edges; memory predecessors are
        // walked back to the work nodes (and allocations) before them.
        let mut stack: Vec<usize> = Vec::new();
        for &(p, d) in &preds[w] {
            if memory(p) {
                stack.push(p);
            } else if kinds[w] != FREE {
                add(p, d);
            } else {
                add(p, full);
            }
        }
        let mut seen = vec![false; nodes.len()];
        while let Some(m) = stack.pop() {
            if std::mem::replace(&mut seen[m], true) {
                continue;
            }
            if kinds[m] == ALLOC {
                add(m, full);
            }
            for &(p, _) in &preds[m] {
                if memory(p) {
                    stack.push(p);
                } else if programmatic && kinds[w] == KERNEL && kinds[p] == KERNEL {
                    add(p, edge_after_kernel);
                } else {
                    add(p, full);
                }
            }
        }
        new_preds[w] = chosen.into_iter().collect();
    }
    // No node may depend on a free: drop those edges from every list (a free's buffer was
    // allocated on its own, so no allocation waits for it).
    for list in new_preds.iter_mut() {
        list.retain(|&(p, _)| kinds[p] != FREE);
    }

    check("removing a graph's edges", sys::cuGraphRemoveDependencies_v2(graph, from.as_ptr(), to.as_ptr(), data.as_ptr(), e))?;
    let (mut nf, mut nt, mut nd) = (Vec::new(), Vec::new(), Vec::new());
    for (w, list) in new_preds.iter().enumerate() {
        for &(p, d) in list {
            nf.push(nodes[p]);
            nt.push(nodes[w]);
            nd.push(d);
        }
    }
    check("adding a graph's edges", sys::cuGraphAddDependencies_v2(graph, nf.as_ptr(), nt.as_ptr(), nd.as_ptr(), nf.len()))
}
