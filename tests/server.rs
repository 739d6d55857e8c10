//! `tern serve` end to end on the tiny golden models: the official `openai` Python client against
//! two servers (one with a concurrency limit of 1, to make backpressure deterministic), then a
//! graceful shutdown on SIGTERM. The checks themselves are in tests/server/openai_client.py.
//!
//! The client runs in the Python named by $TERN_CLIENT_PYTHON (scripts/test.sh makes a venv with
//! the pinned `openai` package); without it the test fails and says so.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::fixtures;

struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(models: &[&str], extra: &[&str]) -> Server {
    let mut args = vec!["serve", "--port", "0", "--threads", "1"];
    for m in models {
        args.extend(["--model", m]);
    }
    args.extend_from_slice(extra);
    let mut child = Command::new(env!("CARGO_BIN_EXE_tern")).args(&args).stderr(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut url = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(rest) = line.split("listening on ").nth(1) {
            url = Some(rest.split_whitespace().next().unwrap().to_string());
        }
        if line.ends_with("ready") {
            break;
        }
        assert!(Instant::now() < deadline, "server did not become ready");
    }
    // Keep draining stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Server { child, url: url.expect("listening line") }
}

#[test]
fn openai_client_against_tern_serve() {
    let python = std::env::var("TERN_CLIENT_PYTHON").unwrap_or_else(|_| {
        panic!("TERN_CLIENT_PYTHON is not set: run scripts/test.sh, which makes a Python with the `openai` client")
    });
    let embed = fixtures().join("egemma300m-tiny-f32").join("model");
    let chat = fixtures().join("qwen35").join("dense-untied");
    let (embed, chat) = (embed.to_str().unwrap(), chat.to_str().unwrap());
    let main = start(&[embed, chat], &["--max-concurrent-requests", "128", "--max-request-bytes", "8388608"]);
    let busy = start(&[embed, chat], &["--max-concurrent-requests", "1"]);
    let report = std::env::temp_dir().join(format!("tern-server-load-{}.json", std::process::id()));
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("server").join("openai_client.py");
    let out = Command::new(&python)
        .arg(&script)
        .args(["--base-url", &main.url, "--busy-url", &busy.url, "--tern", env!("CARGO_BIN_EXE_tern")])
        .args(["--embed-model", embed, "--chat-model", chat, "--server-pid", &main.child.id().to_string()])
        .arg("--report")
        .arg(&report)
        .output()
        .unwrap();
    println!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(out.status.success(), "client checks failed:\n{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // Graceful shutdown: SIGTERM ends the process cleanly.
    for mut s in [main, busy] {
        let pid = s.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(st) = s.child.try_wait().unwrap() {
                break st;
            }
            assert!(Instant::now() < deadline, "server did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(status.success(), "server exited with {status}");
    }
}
