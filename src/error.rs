//! One error type for the whole engine. Every variant names what is wrong and where, so that a
//! command-line user or an HTTP client can act on the message without reading code.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },
    #[error("{path}: unsupported model: {msg}")]
    Unsupported { path: PathBuf, msg: String },
    #[error("tensor `{name}`: {msg}")]
    Tensor { name: String, msg: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("{0}")]
    Input(String),
    #[error("model not found: {0}")]
    NotFound(String),
    #[error("shape: {0}")]
    Shape(String),
    #[error("cuda: {0}")]
    Cuda(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Format { path: path.into(), msg: msg.into() }
    }
    pub fn unsupported(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Unsupported { path: path.into(), msg: msg.into() }
    }
    pub fn tensor(name: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Tensor { name: name.into(), msg: msg.into() }
    }
}
