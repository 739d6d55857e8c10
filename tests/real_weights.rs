//! EmbeddingGemma 300M with its real weights against committed sentence-transformers outputs
//! (scripts/make_real_goldens.py) on real multilingual text up to and past the 2048-token limit.
//! The model directory comes from $TERN_EGEMMA300M_DIR (scripts/test.sh fetches it); without it
//! this test fails rather than pass unchecked.

mod common;

use std::path::PathBuf;

use common::*;
use serde_json::Value;
use tern::runtime::embed::{EmbedOptions, Embedder, LoadOptions};

fn model_dir() -> PathBuf {
    let dir = std::env::var_os("TERN_EGEMMA300M_DIR").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tern/models/embeddinggemma-300m")
    });
    assert!(
        dir.join("model.safetensors").is_file(),
        "EmbeddingGemma 300M is not at {} (set TERN_EGEMMA300M_DIR or run scripts/test.sh, which fetches it)",
        dir.display()
    );
    dir
}

#[test]
fn embeddinggemma_300m_matches_sentence_transformers() {
    let fixture = fixtures().join("egemma300m-real");
    let texts: Vec<String> = std::fs::read_to_string(fixture.join("texts.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["text"].as_str().unwrap().to_string())
        .collect();
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(fixture.join("expected.json")).unwrap()).unwrap();
    let model = Embedder::load(&model_dir(), &LoadOptions { threads: 2, ..LoadOptions::default() }).unwrap();
    assert_eq!(model.tokenizer.max_tokens(), 2048);
    let mut checked = 0;
    let mut worst = (1.0f64, 0.0f64);
    for case in expected["cases"].as_array().unwrap() {
        let opts = EmbedOptions {
            prompt_name: case["prompt_name"].as_str().map(String::from),
            dimensions: case["dims"].as_u64().map(|d| d as usize),
            ..EmbedOptions::default()
        };
        let items = case["items"].as_array().unwrap();
        let batch: Vec<&str> = items.iter().map(|i| texts[i["index"].as_u64().unwrap() as usize].as_str()).collect();
        let (token_ids, _) = model.tokenize(&batch, &opts).unwrap();
        for (item, got) in items.iter().zip(&token_ids) {
            assert_eq!(got, &ids(&item["token_ids"]), "token ids of text {}", item["index"]);
        }
        let out = model.embed(&batch, &opts).unwrap();
        for (i, item) in items.iter().enumerate() {
            let want = floats(&item["embedding"]);
            let what = format!("text {} prompt={:?} dims={:?}", item["index"], opts.prompt_name, opts.dimensions);
            assert_close(out.row(i), &want, &what);
            worst.0 = worst.0.min(cosine(out.row(i), &want));
            worst.1 = worst.1.max(max_abs_diff(out.row(i), &want));
            checked += 1;
        }
    }
    eprintln!("{checked} embeddings; worst cosine {:.8}, worst max |Δ| {:.3e}", worst.0, worst.1);
    assert!(checked >= 350, "only {checked} embeddings checked");
}
