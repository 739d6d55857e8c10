//! Causal depthwise conv1d + SiLU over the fused `[q | k | v]` channels, kernel width K
//! (Qwen3.5: 4), weight `[channels][K]` with tap `K − 1` applied to the current position.
//!
//! Depthwise: channels never interact, so a channel's history, its K weights and its outputs
//! form one independent unit of work. The window at a position is the `K − 1` remembered
//! inputs followed by the position's own input; afterwards the state drops its oldest tap and
//! appends the RAW input, never the convolved or activated value (the next position convolves
//! inputs, so that is what must be remembered, and a prefill may be continued by decode).
//!
//! The accumulation starts from the newest tap and then walks the history oldest-first; with a
//! sum this short a different order shows up in a golden comparison, so every backend keeps it.
//! The single-step form is the scan over one-token segments, through the same launcher, and
//! every position does the same operations in the same order whichever path of the launcher
//! runs it, so a scan of n positions equals n steps bit for bit.

use rayon::prelude::*;

use super::{check_len, check_segments, silu, Segment};
use crate::error::{Error, Result};
use crate::kernels::SharedMut;

/// Channels per task: enough to amortise a task, few enough to spread one sequence's
/// Qwen3.5 conv (8192 channels) over every core.
const CONV_CHANNEL_BLOCK: usize = 256;

/// Below this many (position, channel) updates the launch stays on the calling thread.
const CONV_PARALLEL_WORK: usize = 1 << 14;

/// The one launcher of both forms: every (sequence, channel block) is a task that walks its
/// segment's positions in order.
fn launch_conv(
    what: &str,
    x: &[f32],
    segments: &[Segment],
    weight: &[f32],
    kernel_width: usize,
    conv_states: &mut [&mut [f32]],
    out: &mut [f32],
) -> Result<()> {
    if kernel_width == 0 || weight.is_empty() || weight.len() % kernel_width != 0 {
        return Err(Error::Shape(format!(
            "{what} weight: {} elements are not channels of width {kernel_width}",
            weight.len()
        )));
    }
    let channels = weight.len() / kernel_width;
    let taps = kernel_width - 1;
    if x.len() % channels != 0 {
        return Err(Error::Shape(format!("{what}: {} elements are not rows of {channels} channels", x.len())));
    }
    let tokens = x.len() / channels;
    check_len(&format!("{what} output"), out.len(), x.len())?;
    check_segments(what, segments, tokens)?;
    if conv_states.len() != segments.len() {
        return Err(Error::Shape(format!("{what}: {} conv states for {} sequences", conv_states.len(), segments.len())));
    }
    for (s, state) in conv_states.iter().enumerate() {
        check_len(&format!("{what} conv state of sequence {s}"), state.len(), channels * taps)?;
    }

    let out = SharedMut(out.as_mut_ptr());
    let mut tasks: Vec<(Segment, usize, &mut [f32])> = Vec::new();
    for (&seg, state) in segments.iter().zip(conv_states.iter_mut()) {
        if seg.len == 0 {
            continue;
        }
        if taps == 0 {
            // No history to split: the blocks still partition the channels.
            for c0 in (0..channels).step_by(CONV_CHANNEL_BLOCK) {
                tasks.push((seg, c0, &mut []));
            }
        } else {
            for (b, hist) in state.chunks_mut(taps * CONV_CHANNEL_BLOCK).enumerate() {
                tasks.push((seg, b * CONV_CHANNEL_BLOCK, hist));
            }
        }
    }
    let run = |(seg, c0, hist): (Segment, usize, &mut [f32])| {
        let c1 = (c0 + CONV_CHANNEL_BLOCK).min(channels);
        let nc = c1 - c0;
        let w = &weight[c0 * kernel_width..c1 * kernel_width];
        // Past the first K − 1 positions every tap reads an input row of the segment itself,
        // so whole rows of the block go at once (this loop vectorises; the history walk of
        // per-channel walk below does not), in the same order of operations: the newest tap,
        // then the older ones oldest first, each a product then a sum.
        let mut wt = vec![0.0f32; kernel_width * nc]; // [tap][channel]
        for c in 0..nc {
            for t in 0..kernel_width {
                wt[t * nc + c] = w[c * kernel_width + t];
            }
        }
        let mut acc = vec![0.0f32; nc];
        let head = taps.min(seg.len);
        for p in seg.start..seg.start + seg.len {
            let row = p * channels;
            // SAFETY: segments are disjoint (checked), so row p's channels c0..c1 belong to
            // this task alone; `out` has tokens × channels elements (checked).
            let o = unsafe { std::slice::from_raw_parts_mut(out.ptr().add(row + c0), nc) };
            let xr = &x[row + c0..row + c1];
            if p < seg.start + head {
                // Window reaches into the remembered inputs: the per-channel walk. The history
                // is updated at the end of the segment instead, from the original inputs, so
                // read it here at the position's offset.
                let q = p - seg.start;
                for c in 0..nc {
                    let mut a = xr[c] * wt[taps * nc + c];
                    for t in 0..taps {
                        let src = q + t; // index into [history | segment inputs]
                        let v = if src < taps { hist[c * taps + src] } else { x[(seg.start + src - taps) * channels + c0 + c] };
                        a += v * wt[t * nc + c];
                    }
                    o[c] = silu(a);
                }
                continue;
            }
            for ((a, &xv), &wv) in acc.iter_mut().zip(xr).zip(&wt[taps * nc..]) {
                *a = xv * wv;
            }
            for t in 0..taps {
                let src = &x[(p - taps + t) * channels + c0..(p - taps + t) * channels + c1];
                for ((a, &xv), &wv) in acc.iter_mut().zip(src).zip(&wt[t * nc..(t + 1) * nc]) {
                    *a += xv * wv;
                }
            }
            for (o, &a) in o.iter_mut().zip(&acc) {
                *o = silu(a);
            }
        }
        // The history becomes the last K − 1 entries of [history | segment inputs]; entry i
        // comes from index seg.len + i ≥ i, so walking i upward reads before it overwrites.
        if taps > 0 && seg.len > 0 {
            for c in 0..nc {
                for i in 0..taps {
                    let src = seg.len + i;
                    hist[c * taps + i] = if src < taps { hist[c * taps + src] } else { x[(seg.start + src - taps) * channels + c0 + c] };
                }
            }
        }
    };
    let work: usize = segments.iter().map(|s| s.len).sum::<usize>() * channels;
    if work >= CONV_PARALLEL_WORK && tasks.len() > 1 {
        tasks.into_par_iter().for_each(run);
    } else {
        tasks.into_iter().for_each(run);
    }
    Ok(())
}

/// One decode step for several sequences: row `s` of `x` (`[n_seqs][channels]`) is the next
/// input of sequence `s`, whose conv state `conv_states[s]` is `[channels][K − 1]`.
/// `weight` is `[channels][K]`, K = `kernel_width`; `out` is shaped like `x`.
pub fn conv1d_silu_step(
    x: &[f32],
    weight: &[f32],
    kernel_width: usize,
    conv_states: &mut [&mut [f32]],
    out: &mut [f32],
) -> Result<()> {
    let segments = crate::kernels::pack(std::iter::repeat_n(1, conv_states.len()));
    if kernel_width > 0 && !weight.is_empty() && weight.len() % kernel_width == 0 {
        check_len("conv1d_silu_step input", x.len(), conv_states.len() * (weight.len() / kernel_width))?;
    }
    launch_conv("conv1d_silu_step", x, &segments, weight, kernel_width, conv_states, out)
}

/// The causal conv over a packed batch: `x` is `[tokens][channels]`, sequence `s` owns rows
/// `segments[s]` and carries `conv_states[s]` (`[channels][K − 1]`, raw inputs, oldest first;
/// zero for a fresh sequence), which holds that segment's last `K − 1` inputs afterwards.
/// Rows outside every segment are left untouched in `out`.
pub fn conv1d_silu_scan(
    x: &[f32],
    segments: &[Segment],
    weight: &[f32],
    kernel_width: usize,
    conv_states: &mut [&mut [f32]],
    out: &mut [f32],
) -> Result<()> {
    launch_conv("conv1d_silu_scan", x, segments, weight, kernel_width, conv_states, out)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_bits_eq, Lcg};
    use super::*;
    use crate::kernels::pack;

    fn states_of(buf: &mut [f32], n: usize, per: usize) -> Vec<&mut [f32]> {
        if per == 0 {
            return (0..n).map(|_| <&mut [f32]>::default()).collect();
        }
        buf.chunks_mut(per).collect()
    }

    /// The scan over a packed batch equals, bit for bit, the same positions fed one at a time
    /// through the decode step, and afterwards each state holds its sequence's last K − 1 raw
    /// inputs.
    #[test]
    fn conv_scan_equals_steps_bit_for_bit_and_keeps_raw_inputs() {
        let mut rng = Lcg(7);
        for &(channels, kernel_width) in &[(300usize, 4usize), (2 * 2 * 16 + 4 * 16, 4), (40, 2), (17, 1), (64, 5)] {
            let taps = kernel_width - 1;
            let lengths = [13usize, 1, 0, 6, 3];
            let segments = pack(lengths);
            let tokens: usize = lengths.iter().sum();
            let x = rng.vec(tokens * channels, -3.0, 3.0);
            let w = rng.vec(channels * kernel_width, -1.0, 1.0);
            let init = rng.vec(lengths.len() * channels * taps, -2.0, 2.0);

            let mut scan_state = init.clone();
            let mut scan_out = vec![f32::NAN; x.len()];
            conv1d_silu_scan(&x, &segments, &w, kernel_width, &mut states_of(&mut scan_state, lengths.len(), channels * taps), &mut scan_out)
                .unwrap();

            for (s, seg) in segments.iter().enumerate() {
                let mut state = init[s * channels * taps..(s + 1) * channels * taps].to_vec();
                for p in seg.start..seg.start + seg.len {
                    let mut o = vec![f32::NAN; channels];
                    conv1d_silu_step(&x[p * channels..(p + 1) * channels], &w, kernel_width, &mut [&mut state[..]], &mut o).unwrap();
                    assert_bits_eq("conv output", &scan_out[p * channels..(p + 1) * channels], &o);
                }
                assert_bits_eq("conv state", &scan_state[s * channels * taps..(s + 1) * channels * taps], &state);
                // Raw inputs: the last K − 1 rows of the segment (earlier ones from the initial
                // state when the segment is shorter).
                for c in 0..channels {
                    for t in 0..taps {
                        let back = taps - t; // positions before the end
                        let want = if back <= seg.len {
                            x[(seg.start + seg.len - back) * channels + c]
                        } else {
                            init[s * channels * taps + c * taps + (t + seg.len)]
                        };
                        assert_eq!(state[c * taps + t].to_bits(), want.to_bits(), "K {kernel_width} seq {s} c {c} t {t}");
                    }
                }
            }
        }
    }

    /// The conv against its definition in f64: causal window over the initial history and the
    /// inputs, then x·sigmoid(x).
    #[test]
    fn conv_matches_definition() {
        let mut rng = Lcg(11);
        let (channels, kw, tokens) = (9usize, 4usize, 7usize);
        let x = rng.vec(tokens * channels, -2.0, 2.0);
        let w = rng.vec(channels * kw, -1.0, 1.0);
        let init = rng.vec(channels * (kw - 1), -1.0, 1.0);
        let mut state = init.clone();
        let mut out = vec![0.0f32; x.len()];
        conv1d_silu_scan(&x, &pack([tokens]), &w, kw, &mut [&mut state[..]], &mut out).unwrap();
        for c in 0..channels {
            let mut seq: Vec<f64> = init[c * 3..c * 3 + 3].iter().map(|&v| v as f64).collect();
            seq.extend((0..tokens).map(|p| x[p * channels + c] as f64));
            for p in 0..tokens {
                let acc: f64 = (0..kw).map(|t| seq[p + t] * w[c * kw + t] as f64).sum();
                let want = acc / (1.0 + (-acc).exp());
                assert!((out[p * channels + c] as f64 - want).abs() < 1e-5, "c {c} p {p}");
            }
        }
    }

    #[test]
    fn conv_shape_errors() {
        let w = vec![0.5f32; 8 * 4];
        let mut st = vec![0.0f32; 8 * 3];
        let mut out = vec![0.0f32; 16];
        let x = vec![1.0f32; 16];
        let err = |r: Result<()>| assert!(matches!(r, Err(Error::Shape(_))), "{r:?}");
        err(conv1d_silu_scan(&x[..15], &pack([2]), &w, 4, &mut [&mut st[..]], &mut out[..15]));
        err(conv1d_silu_scan(&x, &pack([3]), &w, 4, &mut [&mut st[..]], &mut out));
        err(conv1d_silu_scan(&x, &pack([2]), &w[..30], 4, &mut [&mut st[..]], &mut out));
        err(conv1d_silu_scan(&x, &pack([2]), &w, 4, &mut [&mut st[..20]], &mut out));
        err(conv1d_silu_scan(&x, &pack([2]), &w, 4, &mut [], &mut out));
        err(conv1d_silu_scan(&x, &pack([2]), &w, 0, &mut [&mut st[..]], &mut out));
        err(conv1d_silu_scan(&x, &pack([2]), &w, 4, &mut [&mut st[..]], &mut out[..8]));
        err(conv1d_silu_step(&x, &w, 4, &mut [&mut st[..]], &mut out));
    }
}
