//! NVRTC, loaded at run time: compiles a kernel family's CUDA C++ source to a CUBIN for the
//! device's architecture, with an on-disk cache.
//!
//! NVRTC is opened by tern itself (libloading), not through cudarc: a missing or mismatched
//! library must be a clear [`Error::Cuda`], never a panic, and the CI check compiles every
//! source on machines that have NVRTC but no GPU and no driver.
//!
//! The cache key is everything that decides the CUBIN: the source text, the compile options,
//! the target architecture and the NVRTC version. A file is named by a 64-bit hash of the key
//! and stores the key itself in front of the CUBIN; a hit needs the stored key to match byte
//! for byte, so a hash collision or a truncated file is a miss, not a wrong kernel.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::{Error, Result};

type Program = *mut c_void;
type Status = c_int;

/// The NVRTC entry points tern uses, resolved once.
struct Api {
    _lib: libloading::Library,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    create: unsafe extern "C" fn(*mut Program, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> Status,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    log: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    destroy: unsafe extern "C" fn(*mut Program) -> Status,
}

/// Library names tried in order when `TERN_NVRTC_LIB` is not set: the CUDA 13 soname (the
/// driver on the GPU machines and the CI wheel are CUDA 13.0), then CUDA 12, then the
/// unversioned development link.
const NVRTC_NAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

fn load_api() -> std::result::Result<Api, String> {
    let explicit = std::env::var_os("TERN_NVRTC_LIB");
    let candidates: Vec<PathBuf> = match &explicit {
        Some(p) => vec![PathBuf::from(p)],
        None => NVRTC_NAMES.iter().map(PathBuf::from).collect(),
    };
    let mut tried = Vec::new();
    for cand in &candidates {
        // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
        match unsafe { libloading::Library::new(cand) } {
            Ok(lib) => return resolve(lib).map_err(|e| format!("{}: {e}", cand.display())),
            Err(e) => tried.push(format!("{}: {e}", cand.display())),
        }
    }
    Err(format!(
        "NVRTC not found (tried {}). Install the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel and put \
         its lib directory on LD_LIBRARY_PATH, or set TERN_NVRTC_LIB to the library's path",
        tried.join("; ")
    ))
}

fn resolve(lib: libloading::Library) -> std::result::Result<Api, libloading::Error> {
    // SAFETY: the signatures are NVRTC's C API (nvrtc.h), stable since CUDA 11.
    unsafe {
        Ok(Api {
            version: *lib.get(b"nvrtcVersion\0")?,
            error_string: *lib.get(b"nvrtcGetErrorString\0")?,
            create: *lib.get(b"nvrtcCreateProgram\0")?,
            compile: *lib.get(b"nvrtcCompileProgram\0")?,
            log_size: *lib.get(b"nvrtcGetProgramLogSize\0")?,
            log: *lib.get(b"nvrtcGetProgramLog\0")?,
            cubin_size: *lib.get(b"nvrtcGetCUBINSize\0")?,
            cubin: *lib.get(b"nvrtcGetCUBIN\0")?,
            destroy: *lib.get(b"nvrtcDestroyProgram\0")?,
            _lib: lib,
        })
    }
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(load_api).as_ref().map_err(|e| Error::Cuda(e.clone()))
}

/// Whether NVRTC can be loaded, and if not why.
pub fn available() -> Result<()> {
    api().map(|_| ())
}

/// NVRTC's (major, minor) version.
pub fn version() -> Result<(i32, i32)> {
    let api = api()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    check(api, unsafe { (api.version)(&mut major, &mut minor) }, "nvrtcVersion")?;
    Ok((major, minor))
}

fn check(api: &Api, status: Status, what: &str) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string for any code.
    let msg = unsafe { CStr::from_ptr((api.error_string)(status)) }.to_string_lossy().into_owned();
    Err(Error::Cuda(format!("{what}: {msg} (NVRTC status {status})")))
}

/// The options every kernel is compiled with, for `arch` such as `"sm_90"`. No fast-math: the
/// decay path needs the precise `expf` (its error would compound along the sequence), and
/// division and square roots stay IEEE-rounded so that the f32 mode matches the CPU ops.
pub fn options(arch: &str) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-default-device".into()];
    if let Some(dir) = std::env::var_os("TERN_CUDA_INCLUDE") {
        o.push(format!("--include-path={}", dir.to_string_lossy()));
    }
    // Source lines in the CUBIN, for a profiler's per-line view (the code is the same).
    if std::env::var("TERN_CUDA_LINEINFO").as_deref() == Ok("1") {
        o.push("-lineinfo".into());
    }
    o
}

/// What every program starts with: the device side of dependent launches (see launch.cuh and
/// [`super::Gpu::launch_builder`]).
pub const PREAMBLE: &str = include_str!("launch.cuh");

/// Compiles `source` (named `name` in diagnostics), after [`PREAMBLE`], to a CUBIN for
/// `arch`, uncached.
pub fn compile(name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    let api = api()?;
    let src = CString::new(format!("{PREAMBLE}\n{source}")).map_err(|_| Error::Cuda(format!("{name}: NUL byte in kernel source")))?;
    let cname = CString::new(name).map_err(|_| Error::Cuda(format!("{name}: NUL byte in kernel name")))?;
    let opts: Vec<CString> = options(arch).into_iter().map(|o| CString::new(o).expect("options have no NUL")).collect();
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: Program = std::ptr::null_mut();
    // SAFETY: valid C strings, no headers passed (count 0, null arrays allowed by the API).
    check(api, unsafe { (api.create)(&mut prog, src.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null()) }, "nvrtcCreateProgram")?;
    // The program is destroyed on every path below.
    let result = (|| {
        // SAFETY: prog is a live program; the option pointers outlive the call.
        let status = unsafe { (api.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        let mut log_len = 0usize;
        // SAFETY: out-pointer to a usize.
        check(api, unsafe { (api.log_size)(prog, &mut log_len) }, "nvrtcGetProgramLogSize")?;
        let mut log = vec![0u8; log_len.max(1)];
        // SAFETY: the buffer holds log_len bytes as NVRTC asked.
        check(api, unsafe { (api.log)(prog, log.as_mut_ptr() as *mut c_char) }, "nvrtcGetProgramLog")?;
        let log = String::from_utf8_lossy(&log).trim_end_matches('\0').trim().to_string();
        if status != 0 {
            check(api, status, &format!("compiling {name} for {arch}"))
                .map_err(|e| Error::Cuda(format!("{e}\n{log}")))?;
        }
        let mut size = 0usize;
        // SAFETY: out-pointer to a usize.
        check(api, unsafe { (api.cubin_size)(prog, &mut size) }, "nvrtcGetCUBINSize")?;
        if size == 0 {
            return Err(Error::Cuda(format!("{name}: NVRTC produced no CUBIN for {arch} (is it a real architecture?)")));
        }
        let mut cubin = vec![0u8; size];
        // SAFETY: the buffer holds `size` bytes as NVRTC asked.
        check(api, unsafe { (api.cubin)(prog, cubin.as_mut_ptr() as *mut c_char) }, "nvrtcGetCUBIN")?;
        Ok(cubin)
    })();
    // SAFETY: prog was created above and is destroyed once.
    let _ = unsafe { (api.destroy)(&mut prog) };
    result
}

/// The cache folder: `$TERN_CUDA_CACHE`, else `$XDG_CACHE_HOME/tern/cuda`, else
/// `~/.cache/tern/cuda`; `None` when none can be named (then nothing is cached).
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("TERN_CUDA_CACHE") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(Path::new(&d).join("tern/cuda"));
    }
    std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/tern/cuda"))
}

/// FNV-1a, 64 bits: only names a cache file; the full key inside the file decides a hit.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

fn cache_key(name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    let (major, minor) = version()?;
    let mut key = format!("tern-cubin-v2\nname {name}\narch {arch}\nnvrtc {major}.{minor}\n").into_bytes();
    for o in options(arch) {
        key.extend_from_slice(format!("option {o}\n").as_bytes());
    }
    key.extend_from_slice(format!("preamble {}\n", PREAMBLE.len()).as_bytes());
    key.extend_from_slice(PREAMBLE.as_bytes());
    key.extend_from_slice(format!("source {}\n", source.len()).as_bytes());
    key.extend_from_slice(source.as_bytes());
    Ok(key)
}

/// [`compile`] through the on-disk cache. A cache that cannot be read or written only costs a
/// compile: the kernel is still returned.
pub fn compile_cached(name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    match cache_dir() {
        Some(dir) => compile_cached_in(&dir, name, source, arch),
        None => compile(name, source, arch),
    }
}

/// [`compile_cached`] with the cache in `dir`.
pub fn compile_cached_in(dir: &Path, name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    let key = cache_key(name, source, arch)?;
    let path = dir.join(format!("{name}-{arch}-{:016x}.cubin", fnv1a(&key)));
    if let Ok(bytes) = std::fs::read(&path) {
        if bytes.len() > 8 {
            let klen = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            if bytes.len() > 8 + klen && bytes[8..8 + klen] == key[..] {
                return Ok(bytes[8 + klen..].to_vec());
            }
        }
    }
    let cubin = compile(name, source, arch)?;
    let mut file = Vec::with_capacity(8 + key.len() + cubin.len());
    file.extend_from_slice(&(key.len() as u64).to_le_bytes());
    file.extend_from_slice(&key);
    file.extend_from_slice(&cubin);
    // Written under a unique name and renamed, so a concurrent reader never sees half a file.
    let tmp = dir.join(format!(".{name}-{}-{:x}.tmp", std::process::id(), fnv1a(&key)));
    if std::fs::create_dir_all(dir).is_ok() && std::fs::write(&tmp, &file).is_ok() && std::fs::rename(&tmp, &path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    Ok(cubin)
}
