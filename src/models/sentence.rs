//! The sentence-transformers pipeline around an encoder, read from the model directory:
//! `modules.json` (Transformer → Pooling → Dense… → Normalize), each module's config,
//! `config_sentence_transformers.json` (prompts) and `sentence_bert_config.json` (length limit).
//! Module types are matched by their last path component, so both the older
//! `sentence_transformers.models.Dense` and the newer `…base.modules.dense.Dense` spellings load.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::formats::config::JsonFile;
use crate::formats::safetensors::SafetensorsWeights;
use crate::formats::Tensor;
use crate::kernels::backend::{CpuOps, Ops};
use crate::kernels::cuda_ops::CudaOps;
use crate::kernels::pool::l2_normalize;
use crate::kernels::Segment;
use crate::models::egemma::{Encoder, EncoderConfig};

/// A Dense module as read from its folder.
pub struct Dense {
    pub weight: Tensor,
    pub bias: Option<Vec<f32>>,
    pub in_features: usize,
    pub out_features: usize,
}

/// A Dense module on a backend.
struct DenseOn<O: Ops> {
    weight: O::Mat,
    bias: Option<O::Vector>,
}

/// The encoder and the Dense modules after pooling, on one backend.
pub struct Stack<O: Ops> {
    pub encoder: Encoder<O>,
    dense: Vec<DenseOn<O>>,
}

impl<O: Ops> Stack<O> {
    fn new(dir: &Path, max_seq_length: usize, dense: Vec<Dense>, ops: O) -> Result<Stack<O>> {
        let encoder = Encoder::load_on(dir, max_seq_length, ops)?;
        let ops = encoder.ops();
        let dense = dense
            .into_iter()
            .map(|d| Ok(DenseOn { weight: ops.matrix(d.weight.into())?, bias: d.bias.map(|b| ops.vector(b)).transpose()? }))
            .collect::<Result<Vec<_>>>()?;
        Ok(Stack { encoder, dense })
    }

    /// Pooled (and Dense-projected) rows, [segments][dim], on the host.
    fn forward(&self, ids: &[u32], segments: &[Segment]) -> Result<Vec<f32>> {
        let ops = self.encoder.ops();
        let ids = self.encoder.checked_ids(ids, segments)?;
        let _one_at_a_time = ops.serialize();
        // The encoder's work depends on nothing but the segments' lengths.
        let key: Vec<u64> = segments.iter().map(|s| s.len as u64).collect();
        let rows = ops.run_step(segments, &ids, &vec![0; segments.len()], Some(&key), &mut |batch| {
            let mut x = self.encoder.forward_batch(batch)?;
            for d in &self.dense {
                x = ops.linear(&x, segments.len(), &d.weight, d.bias.as_ref())?;
            }
            Ok(x)
        }, &|y| ops.to_host_rows(y, segments.len()))?;
        Ok(rows.concat())
    }
}

/// Evaluates `$body` with `$s` bound to the stack of a [`Placed`], whichever backend holds it
/// (the body is the same code, compiled once per backend).
macro_rules! on_stack {
    ($placed:expr, $s:ident => $body:expr) => {
        match $placed {
            Placed::Cpu($s) => $body,
            Placed::Cuda($s) => $body,
        }
    };
}

/// Where the weights live.
pub enum Placed {
    Cpu(Stack<CpuOps>),
    Cuda(Stack<CudaOps>),
}

pub use super::Placement;

pub struct SentencePipeline {
    pub dir: PathBuf,
    pub model: Placed,
    /// (in, out) features of each Dense module.
    pub dense_dims: Vec<(usize, usize)>,
    /// Whether the pipeline ends in a Normalize module.
    pub normalize: bool,
    pub max_seq_length: usize,
    pub prompts: BTreeMap<String, String>,
    pub default_prompt_name: Option<String>,
}

fn module_kind(ty: &str) -> &str {
    ty.rsplit('.').next().unwrap_or(ty)
}

impl SentencePipeline {
    /// Loads the pipeline of `dir` for the CPU.
    pub fn load(dir: &Path) -> Result<SentencePipeline> {
        Self::load_on(dir, &Placement::Cpu)
    }

    /// Loads the pipeline of `dir` onto `placement` (weights uploaded once).
    pub fn load_on(dir: &Path, placement: &Placement) -> Result<SentencePipeline> {
        if !dir.join("config.json").is_file() {
            return Err(Error::format(dir, "not a model directory (no config.json)"));
        }
        let max_seq_length = Self::max_seq_length(dir)?;
        let modules_path = dir.join("modules.json");
        let mut dense = Vec::new();
        let mut normalize = false;
        let mut saw_pooling = false;
        if modules_path.is_file() {
            let text = std::fs::read_to_string(&modules_path).map_err(|e| Error::io(&modules_path, e))?;
            let modules: Vec<Value> = serde_json::from_str(&text)
                .map_err(|e| Error::format(&modules_path, format!("expected a JSON list of modules: {e}")))?;
            for (i, m) in modules.iter().enumerate() {
                let ty = m.get("type").and_then(|v| v.as_str()).ok_or_else(|| {
                    Error::format(&modules_path, format!("module {i} has no `type`"))
                })?;
                let sub = dir.join(m.get("path").and_then(|v| v.as_str()).unwrap_or(""));
                match module_kind(ty) {
                    "Transformer" if i == 0 => {}
                    "Pooling" if i == 1 => {
                        Self::check_pooling(&sub)?;
                        saw_pooling = true;
                    }
                    "Dense" if saw_pooling && !normalize => dense.push(Self::load_dense(&sub)?),
                    "Normalize" if saw_pooling => normalize = true,
                    _ => {
                        return Err(Error::unsupported(
                            &modules_path,
                            format!("module {i} `{ty}` (supported: Transformer, mean Pooling, Dense, Normalize, in that order)"),
                        ))
                    }
                }
            }
            if !saw_pooling {
                return Err(Error::unsupported(&modules_path, "no Pooling module after the Transformer"));
            }
        }
        // Without modules.json, sentence-transformers wraps a plain checkpoint in mean pooling.
        let mut width = EncoderConfig::from_dir(dir)?.out_dim;
        for (i, d) in dense.iter().enumerate() {
            if d.in_features != width {
                return Err(Error::unsupported(
                    dir,
                    format!("Dense module {i} takes {} features but receives {width}", d.in_features),
                ));
            }
            width = d.out_features;
        }
        let st = JsonFile::read_optional(&dir.join("config_sentence_transformers.json"))?;
        let mut prompts = BTreeMap::new();
        let mut default_prompt_name = None;
        if let Some(st) = st {
            if let Some(Value::Object(p)) = st.get("prompts") {
                for (k, v) in p {
                    let v = v.as_str().ok_or_else(|| Error::format(&st.path, format!("prompt `{k}` is not a string")))?;
                    prompts.insert(k.clone(), v.to_string());
                }
            }
            default_prompt_name = st.opt_str("default_prompt_name")?.map(String::from);
        }
        let dense_dims = dense.iter().map(|d| (d.in_features, d.out_features)).collect();
        let model = match placement {
            Placement::Cpu => Placed::Cpu(Stack::new(dir, max_seq_length, dense, CpuOps)?),
            Placement::Cuda(gpu, precision) => {
                Placed::Cuda(Stack::new(dir, max_seq_length, dense, CudaOps::new(gpu.clone(), *precision)?)?)
            }
        };
        let positions = on_stack!(&model, s => s.encoder.max_positions());
        Ok(SentencePipeline {
            dir: dir.to_path_buf(),
            max_seq_length: max_seq_length.min(positions),
            model,
            dense_dims,
            normalize,
            prompts,
            default_prompt_name,
        })
    }

    /// The token limit, as sentence-transformers resolves it: `sentence_bert_config.json`'s
    /// `max_seq_length`, else the tokenizer's `model_max_length` capped by the model's positions.
    fn max_seq_length(dir: &Path) -> Result<usize> {
        let positions = {
            let cfg = JsonFile::read(&dir.join("config.json"))?;
            let text = cfg.sub("text_config").unwrap_or(cfg);
            text.opt_usize("max_position_embeddings")?.unwrap_or(2048)
        };
        if let Some(sb) = JsonFile::read_optional(&dir.join("sentence_bert_config.json"))? {
            if let Some(n) = sb.opt_usize("max_seq_length")? {
                return Ok(n);
            }
        }
        if let Some(tc) = JsonFile::read_optional(&dir.join("tokenizer_config.json"))? {
            // model_max_length is sometimes a float sentinel (1e30) for "no limit".
            if let Some(n) = tc.get("model_max_length").and_then(|v| v.as_f64()) {
                if n >= 1.0 {
                    return Ok((n.min(positions as f64)) as usize);
                }
            }
        }
        Ok(positions)
    }

    fn check_pooling(dir: &Path) -> Result<()> {
        let cfg = JsonFile::read(&dir.join("config.json"))?;
        let mean = match cfg.opt_str("pooling_mode")? {
            Some(mode) => mode == "mean",
            None => {
                let others = [
                    "pooling_mode_cls_token",
                    "pooling_mode_max_tokens",
                    "pooling_mode_mean_sqrt_len_tokens",
                    "pooling_mode_weightedmean_tokens",
                    "pooling_mode_lasttoken",
                ];
                cfg.opt_bool("pooling_mode_mean_tokens")? == Some(true)
                    && others.iter().all(|k| cfg.opt_bool(k).ok().flatten() != Some(true))
            }
        };
        if !mean {
            return Err(Error::unsupported(&cfg.path, "only mean pooling is supported"));
        }
        if cfg.opt_bool("include_prompt")? == Some(false) {
            return Err(Error::unsupported(&cfg.path, "`include_prompt: false` (prompt tokens are always pooled)"));
        }
        Ok(())
    }

    fn load_dense(dir: &Path) -> Result<Dense> {
        let cfg = JsonFile::read(&dir.join("config.json"))?;
        let in_features = cfg.usize("in_features")?;
        let out_features = cfg.usize("out_features")?;
        let act = cfg.opt_str("activation_function")?.unwrap_or("torch.nn.modules.linear.Identity");
        if !act.ends_with("Identity") {
            return Err(Error::unsupported(&cfg.path, format!("Dense activation `{act}` (Identity is supported)")));
        }
        let w = SafetensorsWeights::open_files(&[dir.join("model.safetensors")])?;
        let weight = w.get("linear.weight", &[out_features, in_features])?;
        let bias = match cfg.opt_bool("bias")? {
            Some(false) => None,
            _ if w.contains("linear.bias") => Some(w.get("linear.bias", &[out_features])?.data().to_vec()),
            _ => None,
        };
        Ok(Dense { weight, bias, in_features, out_features })
    }

    /// Width of the pipeline's output.
    pub fn dim(&self) -> usize {
        self.dense_dims.last().map_or(self.cfg().out_dim, |d| d.1)
    }

    pub fn cfg(&self) -> &EncoderConfig {
        on_stack!(&self.model, s => &s.encoder.cfg)
    }

    /// Parameters held (embedding table, projections, Dense modules).
    pub fn param_count(&self) -> usize {
        let dense: usize = self.dense_dims.iter().map(|(i, o)| i * o).sum();
        dense
            + on_stack!(&self.model, s => s.encoder.param_count())
    }

    /// Matmul weights each token passes through (2× is its matmul FLOPs).
    pub fn matmul_params_per_token(&self) -> usize {
        on_stack!(&self.model, s => s.encoder.matmul_params_per_token())
    }

    /// FLOPs of the attention products for one sequence of `len` tokens.
    pub fn attention_flops(&self, len: usize) -> f64 {
        on_stack!(&self.model, s => s.encoder.attention_flops(len))
    }

    /// Where the weights live, in words (`cpu`, or the GPU and precision).
    pub fn device(&self) -> String {
        match &self.model {
            Placed::Cpu(_) => "cpu".into(),
            Placed::Cuda(s) => s.encoder.ops().describe(),
        }
    }

    /// Token ids in, one vector per segment out (on the host): encoder, pooling, Dense modules
    /// and (when `normalize`) the Normalize module.
    pub fn forward(&self, ids: &[u32], segments: &[Segment], normalize: bool) -> Result<Vec<f32>> {
        let mut x = on_stack!(&self.model, s => s.forward(ids, segments))?;
        if self.normalize && normalize {
            l2_normalize(&mut x, self.dim())?;
        }
        Ok(x)
    }
}
