//! Bad input gets a clear error that names what is wrong, a non-zero exit from the CLI, and
//! never a panic. Each case copies a tiny golden checkpoint and breaks one thing.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::fixtures;
use tern::runtime::embed::{EmbedOptions, Embedder, LoadOptions};

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), &to).unwrap();
        }
    }
}

/// A copy of a checkpoint in the temporary directory, removed when dropped (also when the test
/// fails), so that runs leave nothing behind.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh copy of the tiny EmbeddingGemma 300M checkpoint.
fn scratch_model(tag: &str) -> Scratch {
    let dst = std::env::temp_dir().join(format!("tern-bad-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    copy_dir(&fixtures().join("egemma300m-tiny-f32").join("model"), &dst);
    Scratch(dst)
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn load_error(dir: &Path) -> String {
    match Embedder::load(dir, &LoadOptions { threads: 1, ..LoadOptions::default() }) {
        Ok(_) => panic!("{} loaded but should not have", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(msg: &str, needles: &[&str]) {
    for n in needles {
        assert!(msg.contains(n), "error `{msg}` does not mention `{n}`");
    }
}

#[test]
fn missing_weight_file() {
    let d = scratch_model("missing");
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    assert_mentions(&load_error(&d), &["model.safetensors"]);
}

#[test]
fn truncated_weight_file() {
    let d = scratch_model("truncated");
    let p = d.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    assert_mentions(&load_error(&d), &["model.safetensors", "not a valid safetensors file"]);
    std::fs::write(&p, &bytes[..5]).unwrap();
    assert_mentions(&load_error(&d), &["model.safetensors"]);
}

#[test]
fn missing_tokenizer() {
    let d = scratch_model("notok");
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    assert_mentions(&load_error(&d), &["tokenizer.json"]);
}

#[test]
fn unsupported_model_type_is_named() {
    let d = scratch_model("mtype");
    edit_config(&d, |c| c["model_type"] = "bert".into());
    assert_mentions(&load_error(&d), &["model_type", "bert"]);
}

#[test]
fn unsupported_config_values_are_named() {
    let d = scratch_model("act");
    edit_config(&d, |c| c["hidden_activation"] = "relu".into());
    assert_mentions(&load_error(&d), &["hidden_activation", "relu"]);
    let d = scratch_model("causal");
    edit_config(&d, |c| c["use_bidirectional_attention"] = false.into());
    assert_mentions(&load_error(&d), &["use_bidirectional_attention"]);
    let d = scratch_model("heads");
    edit_config(&d, |c| c["num_key_value_heads"] = 3.into());
    assert_mentions(&load_error(&d), &["kv heads"]);
    let d = scratch_model("softcap");
    edit_config(&d, |c| c["attn_logit_softcapping"] = 50.0.into());
    assert_mentions(&load_error(&d), &["attn_logit_softcapping"]);
}

#[test]
fn wrong_tensor_shape_is_named() {
    let d = scratch_model("shape");
    edit_config(&d, |c| c["intermediate_size"] = 100.into());
    assert_mentions(&load_error(&d), &["layers.0.mlp.gate_proj.weight", "[96, 64]", "[100, 64]"]);
}

#[test]
fn malformed_config_json() {
    let d = scratch_model("json");
    std::fs::write(d.join("config.json"), "{\"model_type\": ").unwrap();
    assert_mentions(&load_error(&d), &["config.json", "invalid JSON"]);
}

#[test]
fn request_errors_and_the_empty_string() {
    let dir = fixtures().join("egemma300m-tiny-f32").join("model");
    let m = Embedder::load(&dir, &LoadOptions { threads: 1, ..LoadOptions::default() }).unwrap();
    let opts = EmbedOptions::default();
    assert_mentions(&m.embed(&[], &opts).unwrap_err().to_string(), &["no inputs"]);
    for bad in [0, m.dim() + 1] {
        let o = EmbedOptions { dimensions: Some(bad), ..EmbedOptions::default() };
        assert_mentions(&m.embed(&["x"], &o).unwrap_err().to_string(), &["--dimensions"]);
    }
    let o = EmbedOptions { prompt_name: Some("nope".into()), ..EmbedOptions::default() };
    assert_mentions(&m.embed(&["x"], &o).unwrap_err().to_string(), &["nope", "query"]);
    let err = m.embed_ids(&[vec![2, 100_000, 1]], &opts).unwrap_err().to_string();
    assert_mentions(&err, &["100000", "vocabulary"]);
    let long = "word ".repeat(200);
    let o = EmbedOptions { truncate: false, ..EmbedOptions::default() };
    assert_mentions(&m.embed(&["ok", &long], &o).unwrap_err().to_string(), &["input 1", "limit of 48"]);
    // Truncation is the default, and it is reported.
    let out = m.embed(&["ok", &long], &opts).unwrap();
    assert_eq!(out.truncated.len(), 1);
    assert_eq!(out.truncated[0].0, 1);
    // The empty string is a valid input: BOS and EOS alone.
    let e = m.embed(&[""], &opts).unwrap();
    let norm: f32 = e.row(0).iter().map(|v| v * v).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5);
}

fn tern(args: &[&str], stdin: Option<&[u8]>) -> (i32, String, Vec<u8>) {
    use std::io::Write;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tern"));
    cmd.args(args).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    {
        let mut sin = child.stdin.take().unwrap();
        if let Some(b) = stdin {
            sin.write_all(b).unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned(), out.stdout)
}

#[test]
fn cli_errors_exit_non_zero_with_a_message() {
    let model = fixtures().join("egemma300m-tiny-f32").join("model");
    let m = model.to_str().unwrap();
    let (code, err, _) = tern(&["embed", "--model", m, "--input", "-"], Some(b"good line\n\xff\xfe bad\nthird\n"));
    assert_ne!(code, 0);
    assert_mentions(&err, &["line 2", "UTF-8"]);
    let (code, err, _) = tern(&["embed", "--model", m, "--input", "-"], Some(b""));
    assert_ne!(code, 0);
    assert_mentions(&err, &["no inputs"]);
    let (code, err, _) = tern(&["embed", "--model", "/nonexistent/model/dir"], None);
    assert_ne!(code, 0);
    assert_mentions(&err, &["error:"]);
    assert!(!err.contains("panicked"), "{err}");
    // Precisions: fp16 is refused for EmbeddingGemma; bf16 needs a GPU.
    let (code, err, _) = tern(&["embed", "--model", m, "--dtype", "fp16", "x"], None);
    assert_ne!(code, 0);
    assert_mentions(&err, &["fp16", "overflow"]);
    let (code, err, _) = tern(&["embed", "--model", m, "--device", "cpu", "--dtype", "bf16", "x"], None);
    assert_ne!(code, 0);
    assert_mentions(&err, &["bf16", "CPU"]);
    if tern::cuda::device_count() == 0 {
        let (code, err, _) = tern(&["embed", "--model", m, "--device", "cuda", "x"], None);
        assert_ne!(code, 0);
        assert_mentions(&err, &["cuda"]);
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn hub_id_missing_from_the_cache() {
    let cache = std::env::temp_dir().join(format!("tern-hub-{}", std::process::id()));
    let run = |offline: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_tern"))
            .args(["embed", "--model", "nobody/no-such-model", "x"])
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", offline)
            // A closed loopback port: the download attempt fails at once, on any machine.
            .env("HF_ENDPOINT", "http://127.0.0.1:9")
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = run("1");
    assert_ne!(code, Some(0));
    assert_mentions(&err, &["nobody/no-such-model", "looked in", "models--nobody--no-such-model", "HF_HUB_OFFLINE"]);
    let (code, err) = run("");
    assert_ne!(code, Some(0));
    assert_mentions(&err, &["looked in", "downloading it failed", "config.json"]);
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn cli_outputs_in_input_order() {
    let model = fixtures().join("egemma300m-tiny-f32").join("model");
    let m = model.to_str().unwrap();
    let (code, err, out) = tern(&["embed", "--model", m, "--input", "-"], Some(b"first\n\nthird line\n"));
    assert_eq!(code, 0, "{err}");
    let lines: Vec<serde_json::Value> =
        String::from_utf8(out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3, "an empty middle line is an input; the final newline is not");
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["index"], i);
        assert_eq!(l["embedding"].as_array().unwrap().len(), 64);
    }
    let lib = Embedder::load(&model, &LoadOptions { threads: 1, ..LoadOptions::default() }).unwrap();
    let want = lib.embed(&["third line"], &EmbedOptions::default()).unwrap();
    common::assert_close(&common::floats(&lines[2]["embedding"]), want.row(0), "CLI vs library");
    // npy: a float32 [n, dim] array.
    let path = std::env::temp_dir().join(format!("tern-npy-{}.npy", std::process::id()));
    let (code, err, _) = tern(&["embed", "--model", m, "--format", "npy", "--dimensions", "16", "--output", path.to_str().unwrap(), "a", "b"], None);
    assert_eq!(code, 0, "{err}");
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    assert!(header.contains("'shape': (2, 16)") && header.contains("<f4"), "{header}");
    assert_eq!((10 + header_len) % 64, 0);
    assert_eq!(bytes.len() - 10 - header_len, 2 * 16 * 4);
}

#[test]
fn hub_id_found_in_the_cache() {
    let cache = std::env::temp_dir().join(format!("tern-hubhit-{}", std::process::id()));
    let repo = cache.join("models--someorg--tiny-embedder");
    copy_dir(&fixtures().join("egemma300m-tiny-f32").join("model"), &repo.join("snapshots").join("0123abcd"));
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "0123abcd").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tern"))
        .args(["embed", "--model", "someorg/tiny-embedder", "hello"])
        .env("HF_HUB_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(line["embedding"].as_array().unwrap().len(), 64);
}
