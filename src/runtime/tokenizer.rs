//! The model's own `tokenizer.json`, run by the `tokenizers` crate (the library the Python
//! reference runs too), with the length limit applied the same way: the text is cut so that the
//! special tokens still fit, and a cut is reported rather than hidden.

use std::path::Path;

use tokenizers::{Tokenizer as HfTokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

use crate::error::{Error, Result};

pub struct Tokenizer {
    /// Truncates to `max_tokens`, keeping the post-processor's special tokens.
    inner: HfTokenizer,
    /// The same tokenizer without a limit, made on first need, to count what a cut removed.
    uncut: std::sync::OnceLock<HfTokenizer>,
    max_tokens: usize,
}

/// Token ids of one input, and how many tokens it had before truncation (if it was cut).
pub struct Tokenized {
    pub ids: Vec<u32>,
    pub truncated_from: Option<usize>,
}

impl Tokenizer {
    pub fn load(dir: &Path, max_tokens: usize) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(Error::format(dir, "no tokenizer.json"));
        }
        let mut inner = HfTokenizer::from_file(&path)
            .map_err(|e| Error::format(&path, format!("cannot load the tokenizer: {e}")))?;
        inner.with_padding(None);
        if max_tokens < 2 {
            return Err(Error::Input(format!("a limit of {max_tokens} tokens leaves no room for text")));
        }
        inner
            .with_truncation(Some(TruncationParams {
                max_length: max_tokens,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            }))
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(Tokenizer { inner, uncut: std::sync::OnceLock::new(), max_tokens })
    }

    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Encodes with the special tokens of the tokenizer's post-processor, cut to the limit
    /// exactly as the reference tokenizer call with `truncation=True` cuts.
    pub fn encode(&self, text: &str) -> Result<Tokenized> {
        let enc = self.inner.encode(text, true).map_err(|e| Error::Tokenizer(e.to_string()))?;
        let ids = enc.get_ids().to_vec();
        if enc.get_overflowing().is_empty() {
            return Ok(Tokenized { ids, truncated_from: None });
        }
        let uncut = self.uncut.get_or_init(|| {
            let mut t = self.inner.clone();
            // Removing a limit cannot fail: only a stride larger than the limit is refused.
            let _ = t.with_truncation(None);
            t
        });
        let full = uncut.encode(text, true).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(Tokenized { ids, truncated_from: Some(full.get_ids().len()) })
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| Error::Tokenizer(e.to_string()))
    }
}
