//! The best few entries of each row of logits, so that a step hands the sampler a few pairs
//! instead of the whole vocabulary (a decode round of 128 sequences of Qwen3.5 makes 127 MB of
//! logits; copying them to the host and scanning them there took most of the round). A
//! sampler whose choice depends only on the best entries (greedy, or top-k without penalties)
//! gets exactly what it would have taken from the full row: the same entries, values and order.
//!
//! Two orders, named by the row's divisor:
//! - divisor 0 (greedy): the raw logit, -0 equal to +0 (and returned as +0), ties to the lower
//!   id: the order of `sampler::argmax` (the first maximum wins, by `>`);
//! - divisor t > 0: the value `logit / t` (the sampler's temperature, divided in f32 as the
//!   sampler divides), by `f32::total_cmp`, ties to the lower id: the order of the sampler's
//!   candidates.
//!
//! NaN entries are never taken. CUDA form: `select.cu` and `cuda.rs` beside this file.

pub mod cuda;

use crate::error::{Error, Result};

/// The most entries a row may ask for (the CUDA kernel's shared-memory tables hold this many).
pub const MAX_BEST: usize = 256;

/// What a step returns for one sequence's next-token logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LogitsWant {
    /// The whole row.
    Full,
    /// The `count` best entries (at most [`MAX_BEST`]) in the order `divisor` names.
    Best { divisor: f32, count: usize },
}

impl LogitsWant {
    /// A greedy sampler's request: the one best raw logit.
    pub const ARGMAX: LogitsWant = LogitsWant::Best { divisor: 0.0, count: 1 };

    /// Whether this asks for the one best raw logit (the device answers it with a multi-block
    /// argmax instead of a selection).
    pub fn is_argmax(&self) -> bool {
        *self == Self::ARGMAX
    }
}

/// A sequence's next-token logits as a step returns them ([`LogitsWant`]).
#[derive(Clone, Debug, PartialEq)]
pub enum StepLogits {
    Full(Vec<f32>),
    /// (id, value) pairs, best first; fewer than asked when the row has fewer non-NaN entries.
    Best(Vec<(u32, f32)>),
}

impl StepLogits {
    /// The whole row; an error for a step that returned only the best entries.
    pub fn into_full(self) -> Result<Vec<f32>> {
        match self {
            StepLogits::Full(v) => Ok(v),
            StepLogits::Best(_) => Err(Error::Input("the whole logits row was not asked for".into())),
        }
    }
}

pub(crate) fn check_wants(wants: &[LogitsWant]) -> Result<()> {
    for w in wants {
        if let LogitsWant::Best { divisor, count } = *w {
            if !(divisor >= 0.0 && divisor.is_finite()) || count == 0 || count > MAX_BEST {
                return Err(Error::Input(format!("best logits: divisor {divisor} and count {count} (1 ..= {MAX_BEST})")));
            }
        }
    }
    Ok(())
}

/// The value an entry is ranked by, as an unsigned key whose order is the row's order (larger
/// first); None for NaN. Finite and infinite floats map to their `total_cmp` order by flipping
/// negatives (all bits) and positives (the sign bit); the greedy order first turns -0 into +0.
pub fn rank_key(value: f32, greedy: bool) -> Option<u32> {
    if value.is_nan() {
        return None;
    }
    let v = if greedy && value == 0.0 { 0.0 } else { value };
    let b = v.to_bits();
    Some(if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 })
}

/// The value an entry of `logit` is ranked and returned by: `logit / divisor`, or for divisor
/// 0 the logit itself, -0 read as +0 (the greedy order does not tell them apart).
pub fn ranked_value(logit: f32, divisor: f32) -> f32 {
    if divisor > 0.0 {
        logit / divisor
    } else if logit == 0.0 {
        0.0
    } else {
        logit
    }
}

/// The `count` best (id, value) pairs of `row`, best first (see the module's orders).
pub fn best_entries(row: &[f32], divisor: f32, count: usize) -> Vec<(u32, f32)> {
    let greedy = divisor == 0.0;
    if count == 1 {
        // One entry: a scan, keeping the first of the largest keys.
        let mut best: Option<(u32, u32, f32)> = None;
        for (i, &l) in row.iter().enumerate() {
            let v = ranked_value(l, divisor);
            if let Some(k) = rank_key(v, greedy) {
                if best.is_none_or(|b| k > b.0) {
                    best = Some((k, i as u32, v));
                }
            }
        }
        return best.map(|(_, i, v)| (i, v)).into_iter().collect();
    }
    let mut c: Vec<(u32, u32, f32)> = row
        .iter()
        .enumerate()
        .filter_map(|(i, &l)| {
            let v = ranked_value(l, divisor);
            rank_key(v, greedy).map(|k| (k, i as u32, v))
        })
        .collect();
    let order = |a: &(u32, u32, f32), b: &(u32, u32, f32)| b.0.cmp(&a.0).then(a.1.cmp(&b.1));
    if count < c.len() {
        c.select_nth_unstable_by(count, order);
        c.truncate(count);
    }
    c.sort_unstable_by(order);
    c.into_iter().map(|(_, i, v)| (i, v)).collect()
}

/// Each sequence's logits as `wants` asks, from its row of `vocab` on the host.
pub fn select_rows(rows: Vec<Vec<f32>>, vocab: usize, wants: &[LogitsWant]) -> Result<Vec<StepLogits>> {
    check_wants(wants)?;
    if rows.len() != wants.len() || rows.iter().any(|r| r.len() != vocab) {
        return Err(Error::Shape(format!("{} logits rows for {} sequences of {vocab}", rows.len(), wants.len())));
    }
    Ok(rows
        .into_iter()
        .zip(wants)
        .map(|(row, w)| match *w {
            LogitsWant::Full => StepLogits::Full(row),
            LogitsWant::Best { divisor, count } => StepLogits::Best(best_entries(&row, divisor, count)),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::sampler::argmax;

    #[test]
    fn greedy_order_is_argmax() {
        let rows: [&[f32]; 5] = [
            &[1.0, 3.0, 3.0, -2.0],
            &[-0.0, 0.0, -1.0],
            &[f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY],
            &[f32::NAN, 2.0, f32::INFINITY, f32::INFINITY],
            &[-5.0, -4.0, f32::NAN, -4.0],
        ];
        for row in rows {
            let best = best_entries(row, 0.0, 1);
            let want = argmax(row);
            // argmax's answer when nothing beats -inf is id 0, whatever it holds.
            match best.first() {
                Some(&(id, v)) if v > f32::NEG_INFINITY => assert_eq!(id, want, "{row:?}"),
                _ => assert_eq!(want, 0, "{row:?}"),
            }
        }
    }

    #[test]
    fn scaled_order_is_total_cmp_then_id() {
        let row = [0.5, -0.0, 0.0, 2.0, f32::NAN, 2.0, -1.0, f32::NEG_INFINITY];
        let got = best_entries(&row, 0.5, 6);
        let ids: Vec<u32> = got.iter().map(|e| e.0).collect();
        // +0 ranks above -0 under total_cmp; NaN never appears.
        assert_eq!(ids, vec![3, 5, 0, 2, 1, 6]);
        assert_eq!(got[0].1, 4.0);
        assert_eq!(best_entries(&row, 0.5, 100).len(), 7);
        // One entry (the scan) is the first of the longer lists.
        for divisor in [0.0, 0.5] {
            assert_eq!(best_entries(&row, divisor, 1)[..], best_entries(&row, divisor, 3)[..1]);
        }
    }

    #[test]
    fn bad_wants_are_refused() {
        for w in [
            LogitsWant::Best { divisor: -1.0, count: 1 },
            LogitsWant::Best { divisor: f32::NAN, count: 1 },
            LogitsWant::Best { divisor: 1.0, count: 0 },
            LogitsWant::Best { divisor: 1.0, count: MAX_BEST + 1 },
        ] {
            assert!(select_rows(vec![vec![1.0]], 1, &[w]).is_err(), "{w:?}");
        }
        assert!(select_rows(vec![vec![1.0]], 1, &[]).is_err());
        assert!(select_rows(vec![vec![1.0]], 2, &[LogitsWant::Full]).is_err());
    }
}
