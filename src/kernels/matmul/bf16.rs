//! Products with bf16 weights read as stored (`Y[t][o] = Σ_k X[t][k]·W[o][k]`, W [out][in] bf16,
//! X and Y f32). A bf16 value is the top half of the f32 with the same bits, so widening is a
//! 16-bit shift and exact: these products compute the same f32 maths as decoding W to f32 first,
//! while a decode step streams half the bytes.
//!
//! Three forms, by batch size:
//! - few rows (decode): a fused widen-and-dot kernel over blocks of output rows, each block read
//!   once from memory for every row of X (X stays in L1); rayon over the row blocks;
//! - a few dozen rows (short prompts): each block of four W rows widened once into an L1-sized
//!   buffer, then four rows of X at a time against it (16 accumulators): for these sizes the
//!   GEMM's packing of a freshly widened W costs more than the product itself;
//! - many rows (prefill): panels of W widened into a reused f32 buffer, then the f32 GEMM; the
//!   widening and packing are O(out·in) against the GEMM's O(rows·out·in).

use rayon::prelude::*;


/// Up to this many rows of X take the fused kernel, which widens W again for every X row: it is
/// bound by memory reads at one or two rows; from three, widening each W block once for four X
/// rows wins (Qwen3.5-0.8B decode rounds of 4 and 8 sequences: 155 → 115 ms, 255 → 172 ms).
pub(super) const FUSED_MAX_ROWS: usize = 2;
/// Up to this many (and more than FUSED_MAX_ROWS) take the tiled kernel; more take widen + GEMM
/// (measured on Qwen3.5-0.8B shapes: the tiled form is ahead at 64 rows, the GEMM at 128).
pub(super) const TILED_MAX_ROWS: usize = 96;
/// Weight bytes per task of the small products (see `over_row_blocks`; a decode step is bound by
/// memory reads).
pub(super) const TASK_BYTES: usize = 512 << 10;

#[inline(always)]
pub(crate) fn widen(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Widens `src` into `dst` (equal lengths).
pub(crate) fn widen_into(src: &[u16], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F.
            return unsafe { x86::widen_avx512(src, dst) };
        }
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = widen(s);
    }
}

/// Y = X·Wᵀ for bf16 W; shapes were checked by the caller.
pub(super) fn linear_bf16_into(x: &[f32], rows: usize, w: &[u16], out: usize, inp: usize, y: &mut [f32]) {
    if rows <= FUSED_MAX_ROWS {
        fused(x, rows, w, out, inp, y);
    } else if rows <= TILED_MAX_ROWS {
        tiled(x, rows, w, out, inp, y);
    } else {
        widened_gemm(x, rows, w, out, inp, y);
    }
}

fn fused(x: &[f32], rows: usize, w: &[u16], out: usize, inp: usize, y: &mut [f32]) {
    let kernel = dot_kernel();
    super::over_row_blocks(out, 2 * inp, y, |o0, o1, put| {
        let mut o = o0;
        while o + 4 <= o1 {
            let wr = &w[o * inp..(o + 4) * inp];
            for t in 0..rows {
                let d = kernel(&x[t * inp..(t + 1) * inp], wr, inp);
                for (i, &v) in d.iter().enumerate() {
                    put(t, o + i, v);
                }
            }
            o += 4;
        }
        scalar_tail(x, rows, w, inp, o, o1, put);
    });
}

fn tiled(x: &[f32], rows: usize, w: &[u16], out: usize, inp: usize, y: &mut [f32]) {
    let kernel = tile_kernel();
    let in_registers = tile_bf16_kernel();
    super::over_row_blocks(out, 2 * inp, y, |o0, o1, put| {
        let mut wf = if in_registers.is_some() { Vec::new() } else { vec![0.0f32; 4 * inp] };
        let mut o = o0;
        while o + 4 <= o1 {
            let wb = &w[o * inp..(o + 4) * inp];
            match in_registers {
                Some(k) => super::tile_x_rows(x, rows, inp, o, put, |xs| k(xs, wb, inp)),
                None => {
                    widen_into(wb, &mut wf);
                    super::tile_x_rows(x, rows, inp, o, put, |xs| kernel(xs, &wf, inp));
                }
            }
            o += 4;
        }
        scalar_tail(x, rows, w, inp, o, o1, put);
    });
}

/// The W rows o..o1 left over after the blocks of four.
fn scalar_tail(x: &[f32], rows: usize, w: &[u16], inp: usize, o: usize, o1: usize, put: super::Put) {
    for o in o..o1 {
        let wr = &w[o * inp..(o + 1) * inp];
        for t in 0..rows {
            put(t, o, dot_scalar(&x[t * inp..(t + 1) * inp], wr));
        }
    }
}

fn widened_gemm(x: &[f32], rows: usize, w: &[u16], out: usize, inp: usize, y: &mut [f32]) {
    super::panel_gemm(x, rows, out, inp, y, |o0, p, panel| {
        let src = &w[o0 * inp..(o0 + p) * inp];
        panel.par_chunks_mut(16 * 1024).zip(src.par_chunks(16 * 1024)).for_each(|(d, s)| widen_into(s, d));
    });
}

fn dot_scalar(x: &[f32], w: &[u16]) -> f32 {
    x.iter().zip(w).map(|(&a, &b)| a * widen(b)).sum()
}

/// Four dot products of one X row with four consecutive W rows (`w` holds 4·inp values).
type Dot4 = fn(&[f32], &[u16], usize) -> [f32; 4];

fn dot_kernel() -> Dot4 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return |x, w, n| unsafe { x86::dot4_avx512(x, w, n) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return |x, w, n| unsafe { x86::dot4_avx2(x, w, n) };
        }
    }
    dot4_portable
}

/// Four X rows against four consecutive widened W rows (`w` holds 4·inp f32): `[W row][X row]`.
pub(super) type Tile = fn([&[f32]; 4], &[f32], usize) -> [[f32; 4]; 4];

pub(super) fn tile_kernel() -> Tile {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return |xs, w, n| unsafe { x86::tile_avx512(xs, w, n) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return |xs, w, n| unsafe { x86::tile_avx2(xs, w, n) };
        }
    }
    tile_portable
}

/// Four X rows against four consecutive W rows as stored (bf16), where the CPU has a form that
/// widens in registers.
type TileBf16 = fn([&[f32]; 4], &[u16], usize) -> [[f32; 4]; 4];

fn tile_bf16_kernel() -> Option<TileBf16> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some(|xs, w, n| unsafe { x86::tile_bf16_avx512(xs, w, n) });
        }
    }
    None
}

fn tile_portable(xs: [&[f32]; 4], w: &[f32], n: usize) -> [[f32; 4]; 4] {
    let dot = |x: &[f32], r: usize| x[..n].iter().zip(&w[r * n..(r + 1) * n]).map(|(&p, &q)| p * q).sum::<f32>();
    std::array::from_fn(|r| xs.map(|x| dot(x, r)))
}

fn dot4_portable(x: &[f32], w: &[u16], n: usize) -> [f32; 4] {
    std::array::from_fn(|r| dot_scalar(x, &w[r * n..(r + 1) * n]))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::widen;

    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_avx512(src: &[u16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        while i + 16 <= n {
            let h = _mm256_loadu_si256(sp.add(i) as *const __m256i);
            _mm512_storeu_ps(dp.add(i), _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h))));
            i += 16;
        }
        for j in i..n {
            *dp.add(j) = widen(*sp.add(j));
        }
    }

    /// # Safety
    /// The CPU has AVX-512F; `x` holds n values and `w` 4·n.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot4_avx512(x: &[f32], w: &[u16], n: usize) -> [f32; 4] {
        debug_assert!(x.len() >= n && w.len() >= 4 * n);
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut k = 0;
        while k + 16 <= n {
            let xv = _mm512_loadu_ps(xp.add(k));
            // The next block of four rows follows this one in memory: asking for it now keeps
            // reads in flight across the 4 KiB page boundaries where the hardware prefetcher
            // stops. Prefetches never fault, so reaching past the matrix's end is harmless.
            if k % 32 == 0 {
                for r in 4..8 {
                    _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(r * n + k) as *const i8);
                }
            }
            for (r, a) in acc.iter_mut().enumerate() {
                // 16 bf16 → 16 u32 (zero-extended) → shifted into the f32 high half.
                let h = _mm256_loadu_si256(wp.add(r * n + k) as *const __m256i);
                let wv = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
                *a = _mm512_fmadd_ps(wv, xv, *a);
            }
            k += 16;
        }
        let mut out = [0.0f32; 4];
        for r in 0..4 {
            out[r] = _mm512_reduce_add_ps(acc[r]);
            for j in k..n {
                out[r] += *xp.add(j) * widen(*wp.add(r * n + j));
            }
        }
        out
    }

    /// # Safety
    /// The CPU has AVX-512F; every `xs[i]` holds n values and `w` 4·n.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile_avx512(xs: [&[f32]; 4], w: &[f32], n: usize) -> [[f32; 4]; 4] {
        debug_assert!(xs.iter().all(|x| x.len() >= n) && w.len() >= 4 * n);
        let xp = xs.map(|x| x.as_ptr());
        let wp = w.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); 4]; 4];
        let mut k = 0;
        while k + 16 <= n {
            let xv = xp.map(|p| _mm512_loadu_ps(p.add(k)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let wv = _mm512_loadu_ps(wp.add(r * n + k));
                for i in 0..4 {
                    acc[i] = _mm512_fmadd_ps(wv, xv[i], acc[i]);
                }
            }
            k += 16;
        }
        let mut out = [[0.0f32; 4]; 4];
        for r in 0..4 {
            for i in 0..4 {
                out[r][i] = _mm512_reduce_add_ps(acc[r][i]);
                for j in k..n {
                    out[r][i] += *xp[i].add(j) * *wp.add(r * n + j);
                }
            }
        }
        out
    }

    /// Like [`tile_avx512`], but reading the four W rows as stored (bf16) and widening them in
    /// registers: no widened copy goes through memory, and the loads of the next block are in
    /// flight while this block's 16 FMAs per step run.
    ///
    /// # Safety
    /// The CPU has AVX-512F; every `xs[i]` holds n values and `w` 4·n.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile_bf16_avx512(xs: [&[f32]; 4], w: &[u16], n: usize) -> [[f32; 4]; 4] {
        debug_assert!(xs.iter().all(|x| x.len() >= n) && w.len() >= 4 * n);
        let xp = xs.map(|x| x.as_ptr());
        let wp = w.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); 4]; 4];
        let mut k = 0;
        while k + 16 <= n {
            if k % 32 == 0 {
                for r in 4..8 {
                    _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(r * n + k) as *const i8);
                }
            }
            let xv = xp.map(|p| _mm512_loadu_ps(p.add(k)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let h = _mm256_loadu_si256(wp.add(r * n + k) as *const __m256i);
                let wv = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
                for i in 0..4 {
                    acc[i] = _mm512_fmadd_ps(wv, xv[i], acc[i]);
                }
            }
            k += 16;
        }
        let mut out = [[0.0f32; 4]; 4];
        for r in 0..4 {
            for i in 0..4 {
                out[r][i] = _mm512_reduce_add_ps(acc[r][i]);
                for j in k..n {
                    out[r][i] += *xp[i].add(j) * widen(*wp.add(r * n + j));
                }
            }
        }
        out
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; every `xs[i]` holds n values and `w` 4·n.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_avx2(xs: [&[f32]; 4], w: &[f32], n: usize) -> [[f32; 4]; 4] {
        debug_assert!(xs.iter().all(|x| x.len() >= n) && w.len() >= 4 * n);
        let xp = xs.map(|x| x.as_ptr());
        let wp = w.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); 4]; 4];
        let mut k = 0;
        while k + 8 <= n {
            let xv = xp.map(|p| _mm256_loadu_ps(p.add(k)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let wv = _mm256_loadu_ps(wp.add(r * n + k));
                for i in 0..4 {
                    acc[i] = _mm256_fmadd_ps(wv, xv[i], acc[i]);
                }
            }
            k += 8;
        }
        let mut out = [[0.0f32; 4]; 4];
        for r in 0..4 {
            for i in 0..4 {
                out[r][i] = hsum256(acc[r][i]);
                for j in k..n {
                    out[r][i] += *xp[i].add(j) * *wp.add(r * n + j);
                }
            }
        }
        out
    }

    #[target_feature(enable = "avx2")]
    unsafe fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; `x` holds n values and `w` 4·n.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot4_avx2(x: &[f32], w: &[u16], n: usize) -> [f32; 4] {
        debug_assert!(x.len() >= n && w.len() >= 4 * n);
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut k = 0;
        while k + 8 <= n {
            let xv = _mm256_loadu_ps(xp.add(k));
            // As in the AVX-512 form: the next four rows, one cache line per row every 32 values.
            if k % 32 == 0 {
                for r in 4..8 {
                    _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(r * n + k) as *const i8);
                }
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let h = _mm_loadu_si128(wp.add(r * n + k) as *const __m128i);
                let wv = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)));
                *a = _mm256_fmadd_ps(wv, xv, *a);
            }
            k += 8;
        }
        let mut out = [0.0f32; 4];
        for r in 0..4 {
            let v = acc[r];
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
            out[r] = _mm_cvtss_f32(s);
            for j in k..n {
                out[r] += *xp.add(j) * widen(*wp.add(r * n + j));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to_bf16(v: f32) -> u16 {
        half::bf16::from_f32(v).to_bits()
    }

    /// The f64 sum over the widened weights: what every form must equal up to f32 rounding.
    fn reference(x: &[f32], rows: usize, w: &[u16], out: usize, inp: usize) -> Vec<f64> {
        let mut y = vec![0.0f64; rows * out];
        for t in 0..rows {
            for o in 0..out {
                y[t * out + o] = (0..inp).map(|k| x[t * inp + k] as f64 * widen(w[o * inp + k]) as f64).sum();
            }
        }
        y
    }

    #[test]
    fn vector_widening_matches_the_scalar_one() {
        for n in [0usize, 1, 15, 16, 17, 40, 1000] {
            let src: Vec<u16> = (0..n).map(|i| to_bf16((i as f32 - 20.0) * 0.37)).collect();
            let mut dst = vec![f32::NAN; n];
            widen_into(&src, &mut dst);
            assert!(src.iter().zip(&dst).all(|(&s, &d)| d.to_bits() == widen(s).to_bits()), "n {n}");
        }
    }

    #[test]
    fn widening_is_exact() {
        for v in [0.0f32, -0.0, 1.0, -2.5, 3.140625, 1e-30, -6.5e30, f32::INFINITY] {
            assert_eq!(widen(to_bf16(v)), half::bf16::from_f32(v).to_f32());
        }
    }

    #[test]
    fn every_form_matches_the_f64_sum() {
        // Sizes off the vector widths (in = 37, 100) and on them (64), rows across the fused /
        // GEMM switch, out not a multiple of the 4-row blocks or the task size.
        for &(rows, inp, out) in
            &[(1, 64, 8), (1, 37, 5), (3, 100, 70), (8, 64, 33), (9, 64, 33), (40, 100, 130), (128, 48, 9), (129, 64, 20)]
        {
            let x: Vec<f32> = (0..rows * inp).map(|i| ((i * 7 % 23) as f32 - 11.0) / 7.0).collect();
            let w: Vec<u16> = (0..out * inp).map(|i| to_bf16(((i * 5 % 29) as f32 - 14.0) / 9.0)).collect();
            let mut y = vec![f32::NAN; rows * out];
            linear_bf16_into(&x, rows, &w, out, inp, &mut y);
            let want = reference(&x, rows, &w, out, inp);
            for (i, (&g, &r)) in y.iter().zip(&want).enumerate() {
                assert!((g as f64 - r).abs() <= 1e-5 * (1.0 + r.abs()), "rows {rows} in {inp} out {out} [{i}]: {g} vs {r}");
            }
        }
    }

    /// Every instruction-set form this CPU can run agrees with the portable one (the dispatch
    /// picks only the widest, so the narrower forms are called directly here).
    #[test]
    fn instruction_set_forms_agree() {
        for &n in &[16usize, 37, 64, 1000] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 11 % 19) as f32 - 9.0) / 4.0).collect();
            let w: Vec<u16> = (0..4 * n).map(|i| to_bf16(((i * 7 % 23) as f32 - 11.0) / 6.0)).collect();
            let want = dot4_portable(&x, &w, n);
            let mut forms: Vec<(&str, [f32; 4])> = Vec::new();
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    forms.push(("avx512", unsafe { x86::dot4_avx512(&x, &w, n) }));
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    forms.push(("avx2", unsafe { x86::dot4_avx2(&x, &w, n) }));
                }
            }
            for (name, got) in forms {
                for r in 0..4 {
                    assert!((got[r] - want[r]).abs() <= 1e-5 * (1.0 + want[r].abs()), "{name} n {n} row {r}: {} vs {}", got[r], want[r]);
                }
            }
            let wf: Vec<f32> = w.iter().map(|&b| widen(b)).collect();
            let others: Vec<Vec<f32>> = (1..4).map(|i| x.iter().map(|v| v * -0.5 + i as f32 * 0.25).collect()).collect();
            let xs = [&x[..], &others[0][..], &others[1][..], &others[2][..]];
            let want2 = tile_portable(xs, &wf, n);
            let mut tiles: Vec<(&str, [[f32; 4]; 4])> = Vec::new();
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    tiles.push(("tile avx512", unsafe { x86::tile_avx512(xs, &wf, n) }));
                    tiles.push(("tile bf16 avx512", unsafe { x86::tile_bf16_avx512(xs, &w, n) }));
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    tiles.push(("tile avx2", unsafe { x86::tile_avx2(xs, &wf, n) }));
                }
            }
            for (name, got) in tiles {
                for r in 0..4 {
                    for c in 0..4 {
                        let (g, e) = (got[r][c], want2[r][c]);
                        assert!((g - e).abs() <= 1e-5 * (1.0 + e.abs()), "{name} n {n} [{r}][{c}]: {g} vs {e}");
                    }
                }
            }
        }
    }

    #[test]
    fn matches_the_f32_path_on_widened_weights() {
        let (rows, inp, out) = (2, 256, 96);
        let x: Vec<f32> = (0..rows * inp).map(|i| ((i * 13 % 31) as f32 - 15.0) / 10.0).collect();
        let w: Vec<u16> = (0..out * inp).map(|i| to_bf16(((i * 3 % 17) as f32 - 8.0) / 5.0)).collect();
        let wf: Vec<f32> = w.iter().map(|&b| widen(b)).collect();
        let mut y = vec![0.0f32; rows * out];
        linear_bf16_into(&x, rows, &w, out, inp, &mut y);
        let yf = super::super::linear(&x, rows, &wf, out, inp).unwrap();
        for (a, b) in y.iter().zip(&yf) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}
