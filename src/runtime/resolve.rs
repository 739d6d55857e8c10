//! Model resolution: a local directory, or a hub id (`org/name`) found in the local Hugging Face
//! cache. The cache layout is `models--{org}--{name}/snapshots/{revision}/`, with
//! `refs/main` naming the revision; the cache root follows HF_HUB_CACHE, HF_HOME and
//! XDG_CACHE_HOME as the Hugging Face tools do. A cache miss downloads the model's files into
//! that same layout (unless HF_HUB_OFFLINE is set), so the next run finds them locally.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Where the Hugging Face cache may be, in the order the Hugging Face tools look.
pub fn hub_cache_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    if let Some(p) = std::env::var_os("HF_HUB_CACHE") {
        roots.push(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("HF_HOME") {
        roots.push(PathBuf::from(p).join("hub"));
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        roots.push(PathBuf::from(p).join("huggingface").join("hub"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(home).join(".cache").join("huggingface").join("hub"));
    }
    roots.dedup();
    roots
}

fn snapshot_in(root: &Path, id: &str) -> Option<PathBuf> {
    let repo = root.join(format!("models--{}", id.replace('/', "--")));
    let snapshots = repo.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs").join("main")) {
        let dir = snapshots.join(rev.trim());
        if dir.join("config.json").is_file() {
            return Some(dir);
        }
    }
    // No usable refs/main: the most recently written complete snapshot.
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in std::fs::read_dir(&snapshots).ok()?.flatten() {
        let dir = entry.path();
        if !dir.join("config.json").is_file() {
            continue;
        }
        let t = entry.metadata().and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH);
        if best.as_ref().is_none_or(|(bt, _)| t > *bt) {
            best = Some((t, dir));
        }
    }
    best.map(|(_, d)| d)
}

/// Resolves `spec` to a model directory. A path that exists wins; otherwise `org/name` is looked
/// up in the hub cache. An offline miss names every place that was searched.
pub fn resolve_model(spec: &str) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.exists() && !path.is_dir() {
        return Err(Error::format(path, "expected a model directory"));
    }
    resolve_model_or_file(spec)
}

/// Like [`resolve_model`], but a path to a file (a `.gguf`) is taken as it is.
pub fn resolve_model_or_file(spec: &str) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    let parts: Vec<&str> = spec.split('/').collect();
    let looks_like_id = parts.len() == 2
        && parts.iter().all(|p| !p.is_empty() && !p.starts_with('.'))
        && !spec.contains(char::is_whitespace);
    if !looks_like_id {
        return Err(Error::NotFound(format!("`{spec}` is neither a directory nor a hub id (org/name)")));
    }
    let roots = hub_cache_roots();
    for root in &roots {
        if let Some(dir) = snapshot_in(root, spec) {
            return Ok(dir);
        }
    }
    let looked: Vec<String> =
        roots.iter().map(|r| r.join(format!("models--{}", spec.replace('/', "--"))).display().to_string()).collect();
    let miss = format!(
        "`{spec}` is not a local directory and is not in the Hugging Face cache (looked in: {})",
        looked.join(", ")
    );
    let offline = std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0");
    match roots.first() {
        Some(root) if !offline => download(spec, root).map_err(|e| {
            Error::NotFound(format!("{miss}; downloading it failed: {e}; pass a model directory instead"))
        }),
        _ => Err(Error::NotFound(format!("{miss}; HF_HUB_OFFLINE is set, so nothing was downloaded"))),
    }
}

/// Fetches what an embedding or LLM directory needs into the hub cache under `root`: the config,
/// the tokenizer, the weights (one file or every shard of the index), and the
/// sentence-transformers files with each module's own config and weights.
fn download(spec: &str, root: &Path) -> std::result::Result<PathBuf, String> {
    use hf_hub::api::sync::ApiBuilder;
    use std::io::IsTerminal;
    let api = ApiBuilder::from_env()
        .with_cache_dir(root.to_path_buf())
        .with_progress(std::io::stderr().is_terminal())
        .build()
        .map_err(|e| e.to_string())?;
    let repo = api.model(spec.to_string());
    let required = |f: &str| repo.get(f).map_err(|e| format!("{f}: {e}"));
    // Optional files are simply absent from many repositories.
    let optional = |f: &str| repo.get(f).ok();
    let config = required("config.json")?;
    required("tokenizer.json")?;
    if optional("model.safetensors").is_none() {
        let index = required("model.safetensors.index.json")?;
        let text = std::fs::read_to_string(&index).map_err(|e| e.to_string())?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
        let mut shards: Vec<&str> = json["weight_map"].as_object().into_iter().flatten().filter_map(|(_, v)| v.as_str()).collect();
        shards.sort();
        shards.dedup();
        for shard in shards {
            required(shard)?;
        }
    }
    for f in ["tokenizer_config.json", "config_sentence_transformers.json", "sentence_bert_config.json"] {
        optional(f);
    }
    if let Some(modules) = optional("modules.json") {
        let text = std::fs::read_to_string(&modules).map_err(|e| e.to_string())?;
        let list: Vec<serde_json::Value> = serde_json::from_str(&text).map_err(|e| e.to_string())?;
        for m in &list {
            let path = m["path"].as_str().unwrap_or("");
            if !path.is_empty() {
                optional(&format!("{path}/config.json"));
                if m["type"].as_str().is_some_and(|t| t.ends_with("Dense")) {
                    required(&format!("{path}/model.safetensors"))?;
                }
            }
        }
    }
    config.parent().map(Path::to_path_buf).ok_or_else(|| "the cache returned a path without a folder".to_string())
}
