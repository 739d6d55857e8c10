//! The model's own tokenizer, run by the `tokenizers` crate (the library the Python reference
//! runs too): from a `tokenizer.json`, or rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.
//!
//! For embeddings the length limit is applied the way the reference applies it: the text is cut
//! so that the special tokens still fit, and a cut is reported rather than hidden. For generation
//! there is no limit here (the context check belongs to the model) and every token's raw bytes
//! are available, so that streamed text never splits a UTF-8 character.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};
use tokenizers::{Tokenizer as HfTokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

use crate::error::{Error, Result};
use crate::formats::gguf::GgufFile;

pub struct Tokenizer {
    /// Truncates to `max_tokens` when a limit is set, keeping the post-processor's special tokens.
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

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_attr` order).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;
const TOKEN_TYPE_UNUSED: i32 = 5;

/// Pre-tokenizer regexes of the byte-level BPE vocabularies tern's LLMs use, by the GGUF
/// `tokenizer.ggml.pre` name that llama.cpp's converter writes. Qwen3.5 added `\p{M}` to the
/// letter classes of Qwen2's expression, so combining marks stay with their letters.
const PRETOKENIZE_QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const PRETOKENIZE_QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The vocabulary part of a GGUF file's tokenizer metadata.
pub struct GgufVocab<'a> {
    /// `tokenizer.ggml.model`: only `gpt2` (byte-level BPE) is read.
    pub model: &'a str,
    /// `tokenizer.ggml.pre`: selects the pre-tokenizer regex.
    pub pre: &'a str,
    pub tokens: &'a [String],
    pub token_types: &'a [i32],
    /// `"left right"` pairs, highest priority first.
    pub merges: &'a [String],
}

impl Tokenizer {
    /// `tokenizer.json` of a model directory, cut to `max_tokens` (embedding models).
    pub fn load(dir: &Path, max_tokens: usize) -> Result<Tokenizer> {
        if max_tokens < 2 {
            return Err(Error::Input(format!("a limit of {max_tokens} tokens leaves no room for text")));
        }
        let mut t = Self::load_file(dir)?;
        t.inner
            .with_truncation(Some(TruncationParams {
                max_length: max_tokens,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            }))
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        t.max_tokens = max_tokens;
        Ok(t)
    }

    /// `tokenizer.json` of a model directory, without a length limit (LLMs).
    pub fn load_file(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(Error::format(dir, "no tokenizer.json"));
        }
        let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
        Self::from_bytes(&bytes).map_err(|e| Error::format(&path, format!("cannot load the tokenizer: {e}")))
    }

    /// A serialized `tokenizer.json`, without a length limit.
    pub fn from_bytes(bytes: &[u8]) -> Result<Tokenizer> {
        let mut inner = HfTokenizer::from_bytes(bytes).map_err(|e| Error::Tokenizer(e.to_string()))?;
        inner.with_padding(None);
        Ok(Tokenizer { inner, uncut: std::sync::OnceLock::new(), max_tokens: usize::MAX })
    }

    /// The tokenizer embedded in a GGUF file by llama.cpp's converter.
    pub fn from_gguf(f: &GgufFile) -> Result<Tokenizer> {
        let vocab = GgufVocab {
            model: f.get_str("tokenizer.ggml.model")?,
            pre: f.opt_str("tokenizer.ggml.pre")?.unwrap_or("default"),
            tokens: f.get_str_array("tokenizer.ggml.tokens")?,
            token_types: &f.get_i32_array("tokenizer.ggml.token_type")?,
            merges: f.get_str_array("tokenizer.ggml.merges")?,
        };
        Self::from_gguf_vocab(&vocab).map_err(|e| match e {
            Error::Input(msg) | Error::Tokenizer(msg) => Error::format(f.path(), msg),
            other => other,
        })
    }

    /// Rebuilds the byte-level BPE pipeline the GGUF vocabulary came from: NFC, the `pre`
    /// regex split, byte-level mapping, BPE over the stored merges, and control/user-defined
    /// tokens matched verbatim as special tokens. Unused (padding) entries are left out, so they
    /// decode to nothing, as ids past a Hugging Face tokenizer's vocabulary do.
    pub fn from_gguf_vocab(v: &GgufVocab) -> Result<Tokenizer> {
        if v.model != "gpt2" {
            return Err(Error::Input(format!(
                "tokenizer model `{}` is not supported (tern reads byte-level BPE, `gpt2`)",
                v.model
            )));
        }
        let regex = match v.pre {
            "qwen35" => PRETOKENIZE_QWEN35,
            "qwen2" => PRETOKENIZE_QWEN2,
            other => {
                return Err(Error::Input(format!(
                    "tokenizer pre-tokenizer `{other}` is not supported (supported: qwen35, qwen2)"
                )))
            }
        };
        if v.token_types.len() != v.tokens.len() {
            return Err(Error::Input(format!(
                "tokenizer.ggml.token_type has {} entries for {} tokens",
                v.token_types.len(),
                v.tokens.len()
            )));
        }
        let mut vocab = serde_json::Map::new();
        let mut added = Vec::new();
        for (id, (tok, &ty)) in v.tokens.iter().zip(v.token_types).enumerate() {
            match ty {
                TOKEN_TYPE_UNUSED => {}
                TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED => added.push(json!({
                    "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                    "normalized": false, "special": true,
                })),
                _ => {
                    vocab.insert(tok.clone(), json!(id));
                }
            }
        }
        let mut merges = Vec::with_capacity(v.merges.len());
        for (i, m) in v.merges.iter().enumerate() {
            let Some((a, b)) = m.split_once(' ') else {
                return Err(Error::Input(format!("tokenizer.ggml.merges[{i}] `{m}` is not a `left right` pair")));
            };
            merges.push(json!([a, b]));
        }
        let spec = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
            ]},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                // A pre-token that is itself in the vocabulary is that token, as with tiktoken's
                // ranks that Qwen's vocabulary comes from (a merge list converted from ranks need
                // not reach every such token; with a complete list the two rules agree).
                "ignore_merges": true,
                "vocab": Value::Object(vocab), "merges": merges,
            },
        });
        let bytes = serde_json::to_vec(&spec).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Self::from_bytes(&bytes)
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

    /// Token ids of `text` as a chat template renders it: no special tokens added, and special
    /// tokens written in the text (`<|im_start|>`) matched as such.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Ids of the special (added) tokens, by their text.
    pub fn special_tokens(&self) -> HashMap<String, u32> {
        self.inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (t.content, id))
            .collect()
    }

    /// The bytes each id decodes to, indexed by id up to `n` (ids the tokenizer does not know,
    /// such as embedding rows past the vocabulary, decode to nothing). Byte-level BPE tokens
    /// are strings over the 256-character byte alphabet; mapping them back gives the raw bytes,
    /// which may be part of a UTF-8 character, so the caller can stream text without splitting
    /// one.
    pub fn token_bytes(&self, n: usize) -> Vec<Vec<u8>> {
        let byte_of = byte_level_decoder();
        let added = self.inner.get_added_tokens_decoder();
        (0..n as u32)
            .map(|id| {
                if let Some(t) = added.get(&id) {
                    return t.content.as_bytes().to_vec();
                }
                let Some(tok) = self.inner.id_to_token(id) else { return Vec::new() };
                let mapped: Option<Vec<u8>> = tok.chars().map(|c| byte_of.get(&c).copied()).collect();
                // A token outside the byte alphabet (not a byte-level vocabulary): its decoded text.
                mapped.unwrap_or_else(|| self.inner.decode(&[id], false).unwrap_or_default().into_bytes())
            })
            .collect()
    }
}

/// The inverse of byte-level BPE's byte → character table: printable Latin-1 bytes stand for
/// themselves, the other 68 bytes are shifted to U+0100 and up, in byte order.
fn byte_level_decoder() -> HashMap<char, u8> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut map = HashMap::with_capacity(256);
    let mut shifted = 0u32;
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            shifted += 1;
            char::from_u32(0xFF + shifted).unwrap_or('\0')
        };
        map.insert(c, b);
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_is_a_bijection() {
        let m = byte_level_decoder();
        assert_eq!(m.len(), 256);
        let mut bytes: Vec<u8> = m.values().copied().collect();
        bytes.sort();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
        // The two well-known shifted characters: space is Ġ (U+0120), newline is Ċ (U+010A).
        assert_eq!(m[&'Ġ'], b' ');
        assert_eq!(m[&'Ċ'], b'\n');
        assert_eq!(m[&'a'], b'a');
    }
}
