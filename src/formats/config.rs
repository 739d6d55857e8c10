//! Typed access to JSON configuration files with errors that name the file and the key.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};

/// A parsed JSON object and the file it came from.
pub struct JsonFile {
    pub path: PathBuf,
    pub value: Value,
}

impl JsonFile {
    pub fn read(path: &Path) -> Result<JsonFile> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| Error::format(path, format!("invalid JSON: {e}")))?;
        if !value.is_object() {
            return Err(Error::format(path, "expected a JSON object"));
        }
        Ok(JsonFile { path: path.to_path_buf(), value })
    }

    /// Reads `path` when it exists; `None` when it does not.
    pub fn read_optional(path: &Path) -> Result<Option<JsonFile>> {
        if path.exists() { Self::read(path).map(Some) } else { Ok(None) }
    }

    /// A view of a nested object, keeping the file for error messages.
    pub fn sub(&self, key: &str) -> Option<JsonFile> {
        self.value.get(key).filter(|v| v.is_object()).map(|v| JsonFile { path: self.path.clone(), value: v.clone() })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.value.get(key).filter(|v| !v.is_null())
    }

    fn bad(&self, key: &str, want: &str) -> Error {
        Error::format(&self.path, format!("`{key}` must be {want}"))
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| Error::format(&self.path, format!("missing `{key}`")))
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| self.bad(key, "a non-negative integer")),
        }
    }

    pub fn f64(&self, key: &str) -> Result<f64> {
        self.opt_f64(key)?.ok_or_else(|| Error::format(&self.path, format!("missing `{key}`")))
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.bad(key, "a number")),
        }
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.bad(key, "true or false")),
        }
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.bad(key, "a string")),
        }
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        self.opt_str(key)?.ok_or_else(|| Error::format(&self.path, format!("missing `{key}`")))
    }

    pub fn opt_str_list(&self, key: &str) -> Result<Option<Vec<String>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(String::from).ok_or_else(|| self.bad(key, "a list of strings")))
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(_) => Err(self.bad(key, "a list of strings")),
        }
    }

    /// Fails with a message naming `key` unless the config value is absent or equals `want`.
    pub fn require_absent_or(&self, key: &str, want: &Value, why: &str) -> Result<()> {
        match self.get(key) {
            None => Ok(()),
            Some(v) if v == want => Ok(()),
            Some(v) => Err(Error::unsupported(&self.path, format!("`{key}` = {v} ({why})"))),
        }
    }
}
