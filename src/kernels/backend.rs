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
use crate::formats::Tensor;
use crate::kernels::attention::{attention_views, AttentionShape};
use crate::kernels::matmul::linear;
use crate::kernels::norm::{add_norm, rms_norm};
use crate::kernels::pool::mean_pool;
use crate::kernels::rope::{head_prep_view, HeadPrep, RopeTable};
use crate::kernels::Segment;

/// Rows of a buffer: row r is `width` elements at `offset + r·stride` (width known to the op).
pub struct View<'a, B> {
    pub buf: &'a B,
    pub offset: usize,
    pub stride: usize,
}

impl<'a, B> View<'a, B> {
    pub fn new(buf: &'a B, offset: usize, stride: usize) -> Self {
        View { buf, offset, stride }
    }
}

/// What [`Ops::head_prep`] does to each head: RMS-norm (with or without a weight) and RoPE.
pub struct HeadOps<'a, O: Ops> {
    pub heads: usize,
    pub hd: usize,
    pub norm: Option<Option<&'a O::Vector>>,
    pub eps: f32,
    pub rope: Option<&'a O::Rope>,
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

    fn matrix(&self, w: Tensor) -> Result<Self::Mat>;
    /// Matrices that read the same input, stacked by output rows: one [`Ops::linear`] with the
    /// result writes `[rows][Σ out]`, each part's outputs side by side. A GPU stacks them into one
    /// GEMM (fewer, larger launches).
    fn stacked(&self, name: String, parts: Vec<Tensor>) -> Result<Self::Mat> {
        self.matrix(Tensor::concat_rows(name, &parts)?)
    }
    fn vector(&self, v: Vec<f32>) -> Result<Self::Vector>;
    fn table(&self, t: Tensor) -> Result<Self::Table>;
    fn rope(&self, t: RopeTable) -> Result<Self::Rope>;
    /// The batch of `ids` laid out by `segments`; the ids were checked against the vocabulary.
    fn batch(&self, segments: &[Segment], ids: &[u32]) -> Result<Self::Batch>;
    /// Runs `f` on the batch of `ids` and returns its result on the host. A backend may record
    /// the work `f` queues for one shape of batch and replay it for the next batch of that shape
    /// (CUDA graphs), so `f` must queue the same work for batches of the same shape.
    fn run_batch(&self, segments: &[Segment], ids: &[u32], f: &dyn Fn(&Self::Batch) -> Result<Self::Buf>) -> Result<Vec<f32>> {
        let batch = self.batch(segments, ids)?;
        let y = f(&batch)?;
        self.to_host(&y)
    }
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
    /// `gelu_tanh(g)·u` over `rows × width`, contiguous out.
    fn gelu_tanh_mul(&self, g: View<Self::Buf>, u: View<Self::Buf>, rows: usize, width: usize) -> Result<Self::Buf>;
    /// In place on the heads of `x`'s rows from `offset` (row stride `stride`), at each row's
    /// position in `batch`.
    fn head_prep(&self, x: &mut Self::Buf, offset: usize, stride: usize, batch: &Self::Batch, prep: &HeadOps<Self>)
        -> Result<()>;
    /// Attention within each sequence of `batch`; out is [rows][q_heads·hd].
    fn attention(
        &self,
        q: View<Self::Buf>,
        k: View<Self::Buf>,
        v: View<Self::Buf>,
        batch: &Self::Batch,
        shape: &AttentionShape,
    ) -> Result<Self::Buf>;
    /// Mean of each sequence's rows, [sequences][d].
    fn mean_pool(&self, h: &Self::Buf, d: usize, batch: &Self::Batch) -> Result<Self::Buf>;
    fn to_host(&self, x: &Self::Buf) -> Result<Vec<f32>>;
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
    pub parts: Vec<Tensor>,
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

impl Ops for CpuOps {
    type Buf = Vec<f32>;
    type Mat = CpuMat;
    type Vector = Vec<f32>;
    type Table = Tensor;
    type Rope = RopeTable;
    type Batch = CpuBatch;

    fn matrix(&self, w: Tensor) -> Result<CpuMat> {
        let (out, inp) = matrix_dims(&w)?;
        Ok(CpuMat { parts: vec![w], out, inp })
    }

    fn stacked(&self, name: String, parts: Vec<Tensor>) -> Result<CpuMat> {
        let (mut out, mut inp) = (0, None);
        for t in &parts {
            let (o, i) = matrix_dims(t)?;
            if *inp.get_or_insert(i) != i {
                return Err(Error::tensor(&t.name, format!("{i} columns cannot stack in {name} under rows of {}", inp.unwrap_or(0))));
            }
            out += o;
        }
        let inp = inp.ok_or_else(|| Error::tensor(&name, "nothing to stack"))?;
        Ok(CpuMat { parts, out, inp })
    }
    fn vector(&self, v: Vec<f32>) -> Result<Vec<f32>> {
        Ok(v)
    }
    fn table(&self, t: Tensor) -> Result<Tensor> {
        matrix_dims(&t)?;
        Ok(t)
    }
    fn rope(&self, t: RopeTable) -> Result<RopeTable> {
        Ok(t)
    }
    fn batch(&self, segments: &[Segment], ids: &[u32]) -> Result<CpuBatch> {
        Ok(CpuBatch::new(segments, ids))
    }

    fn segments<'b>(&self, batch: &'b CpuBatch) -> &'b [Segment] {
        &batch.segments
    }

    fn embed(&self, table: &Tensor, batch: &CpuBatch, scale: f32) -> Result<Vec<f32>> {
        crate::kernels::embedding::embed_lookup(table, &batch.ids, scale)
    }

    fn linear(&self, x: &Vec<f32>, rows: usize, w: &CpuMat, bias: Option<&Vec<f32>>) -> Result<Vec<f32>> {
        let mut y = match &w.parts[..] {
            [one] => linear(x, rows, one.data(), w.out, w.inp)?,
            parts => {
                let mut y = vec![0.0f32; rows * w.out];
                let mut col = 0;
                for p in parts {
                    let o = p.shape[0];
                    crate::kernels::matmul::linear_into_columns(x, rows, p.data(), o, w.inp, &mut y, col, w.out)?;
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

    fn head_prep(&self, x: &mut Vec<f32>, offset: usize, stride: usize, batch: &CpuBatch, prep: &HeadOps<Self>) -> Result<()> {
        let p = HeadPrep { heads: prep.heads, hd: prep.hd, norm: prep.norm.map(|w| w.map(|w| &w[..])), eps: prep.eps, rope: prep.rope };
        head_prep_view(x, offset, stride, batch.rows(), &batch.positions, &p)
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
        ops.head_prep(&mut x, 2, 6, &batch, &prep).unwrap();
        // Columns 2..4 of each 6-wide row are RMS-normalised; the others are untouched.
        let inv = |a: f32, b: f32| 1.0 / ((a * a + b * b) / 2.0).sqrt();
        assert_eq!(&x[..2], &[1.0, 2.0]);
        assert!((x[2] - 3.0 * inv(3.0, 4.0)).abs() < 1e-6 && (x[3] - 4.0 * inv(3.0, 4.0)).abs() < 1e-6);
        assert_eq!(&x[4..8], &[5.0, 6.0, 7.0, 8.0]);
        assert!((x[8] - 9.0 * inv(9.0, 10.0)).abs() < 1e-6);
        assert_eq!(&x[10..], &[11.0, 12.0]);
    }
}
