//! GGUF weights and metadata (llama.cpp's single-file format, versions 2 and 3, little-endian),
//! memory-mapped.
//!
//! Hand-written rather than taken from a crate: none of the GGUF crates is both well kept and able
//! to hand out zero-copy views into the map while checking every count, length and offset against
//! the file before anything is allocated or sliced. The format is small enough that owning the
//! parser costs less than working around one: a header (magic, version, tensor count, metadata
//! count), typed key-value metadata, a table of tensor infos, then the tensor data, which starts at
//! the next multiple of `general.alignment` (32 when absent) and in which every tensor's offset is
//! a multiple of the alignment too.
//!
//! Shapes: GGUF lists a tensor's dimensions fastest-varying first (ggml's `ne`; `ne[0]` is the row
//! length). [`GgufTensorInfo::shape`] reverses them into PyTorch order, so a weight that
//! safetensors stores as `[out, in]` has shape `[out, in]` here too, and the data is row-major in
//! that shape; [`GgufTensorInfo::dims`] keeps the file's order.
//!
//! Decoding: [`GgufFile::load`] gives f32 (the numerics contract keeps every weight in f32): F32
//! as a zero-copy view of the map when 4-byte aligned, F16, BF16 and Q8_0 decoded on load. Other
//! ggml types are refused there, by name, but [`GgufFile::raw`] hands out any tensor's bytes and
//! type for kernels that work on quantized blocks directly.
//!
//! Validation: a corrupt or truncated file gives an error naming the file (and the key or tensor),
//! never a panic. Counts and lengths are bounded by the bytes left before anything is allocated
//! for them, so a hostile header cannot make the reader allocate more than the file's size;
//! nested arrays are depth-limited; every tensor's data must lie inside the file, aligned, and no
//! two tensors may overlap.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;

use super::{Bf16Tensor, Matrix, Q8Tensor, Tensor};
use crate::error::{Error, Result};

/// The alignment of the data section and of every tensor's offset when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: usize = 4;
/// Arrays of arrays are legal; real files nest at most once or twice. The limit keeps a hostile
/// file (12 bytes per level) from recursing deep enough to overflow the stack.
const MAX_ARRAY_DEPTH: usize = 8;
/// Elements decoded per parallel task: below this, threads cost more than they save.
const PAR_MIN_LEN: usize = 1 << 14;

// ---------------------------------------------------------------------------------------------
// ggml tensor types

/// A ggml tensor type, by its number in the file. A number rather than an enum so that a type
/// newer than this reader still opens (its tensors are refused only when used) and prints as its
/// number.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q5_0: GgmlType = GgmlType(6);
    pub const Q5_1: GgmlType = GgmlType(7);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const Q8_1: GgmlType = GgmlType(9);
    pub const Q2_K: GgmlType = GgmlType(10);
    pub const Q3_K: GgmlType = GgmlType(11);
    pub const Q4_K: GgmlType = GgmlType(12);
    pub const Q5_K: GgmlType = GgmlType(13);
    pub const Q6_K: GgmlType = GgmlType(14);
    pub const Q8_K: GgmlType = GgmlType(15);
    pub const IQ2_XXS: GgmlType = GgmlType(16);
    pub const IQ2_XS: GgmlType = GgmlType(17);
    pub const IQ3_XXS: GgmlType = GgmlType(18);
    pub const IQ1_S: GgmlType = GgmlType(19);
    pub const IQ4_NL: GgmlType = GgmlType(20);
    pub const IQ3_S: GgmlType = GgmlType(21);
    pub const IQ2_S: GgmlType = GgmlType(22);
    pub const IQ4_XS: GgmlType = GgmlType(23);
    pub const I8: GgmlType = GgmlType(24);
    pub const I16: GgmlType = GgmlType(25);
    pub const I32: GgmlType = GgmlType(26);
    pub const I64: GgmlType = GgmlType(27);
    pub const F64: GgmlType = GgmlType(28);
    pub const IQ1_M: GgmlType = GgmlType(29);
    pub const BF16: GgmlType = GgmlType(30);
    pub const TQ1_0: GgmlType = GgmlType(34);
    pub const TQ2_0: GgmlType = GgmlType(35);
    pub const MXFP4: GgmlType = GgmlType(39);
    pub const NVFP4: GgmlType = GgmlType(40);
    pub const Q1_0: GgmlType = GgmlType(41);

    /// Name, elements per block, bytes per block. A block size of 0 marks types ggml has retired
    /// (Q4_2, Q4_3, and the repacked Q4_0_x_y / IQ4_NL_x_y layouts, which are never in files now).
    const TABLE: &'static [(u32, &'static str, usize, usize)] = &[
        (0, "F32", 1, 4),
        (1, "F16", 1, 2),
        (2, "Q4_0", 32, 2 + 16),
        (3, "Q4_1", 32, 2 + 2 + 16),
        (4, "Q4_2", 0, 0),
        (5, "Q4_3", 0, 0),
        (6, "Q5_0", 32, 2 + 4 + 16),
        (7, "Q5_1", 32, 2 + 2 + 4 + 16),
        (8, "Q8_0", 32, 2 + 32),
        (9, "Q8_1", 32, 4 + 4 + 32),
        (10, "Q2_K", 256, 2 + 2 + 16 + 64),
        (11, "Q3_K", 256, 2 + 64 + 32 + 12),
        (12, "Q4_K", 256, 2 + 2 + 128 + 12),
        (13, "Q5_K", 256, 2 + 2 + 128 + 32 + 12),
        (14, "Q6_K", 256, 2 + 128 + 64 + 16),
        (15, "Q8_K", 256, 4 + 256 + 32),
        (16, "IQ2_XXS", 256, 2 + 64),
        (17, "IQ2_XS", 256, 2 + 64 + 8),
        (18, "IQ3_XXS", 256, 2 + 64 + 32),
        (19, "IQ1_S", 256, 2 + 32 + 16),
        (20, "IQ4_NL", 32, 2 + 16),
        (21, "IQ3_S", 256, 2 + 64 + 32 + 8 + 4),
        (22, "IQ2_S", 256, 2 + 64 + 16),
        (23, "IQ4_XS", 256, 2 + 2 + 128 + 4),
        (24, "I8", 1, 1),
        (25, "I16", 1, 2),
        (26, "I32", 1, 4),
        (27, "I64", 1, 8),
        (28, "F64", 1, 8),
        (29, "IQ1_M", 256, 32 + 16 + 8),
        (30, "BF16", 1, 2),
        (31, "Q4_0_4_4", 0, 0),
        (32, "Q4_0_4_8", 0, 0),
        (33, "Q4_0_8_8", 0, 0),
        (34, "TQ1_0", 256, 2 + 4 * 13),
        (35, "TQ2_0", 256, 2 + 64),
        (36, "IQ4_NL_4_4", 0, 0),
        (37, "IQ4_NL_4_8", 0, 0),
        (38, "IQ4_NL_8_8", 0, 0),
        (39, "MXFP4", 32, 1 + 16),
        (40, "NVFP4", 64, 4 + 32),
        (41, "Q1_0", 128, 2 + 16),
    ];

    fn entry(self) -> Option<&'static (u32, &'static str, usize, usize)> {
        Self::TABLE.get(self.0 as usize).filter(|e| e.0 == self.0)
    }

    /// ggml's name for the type (`"Q8_0"`), `None` for a number this reader does not know.
    pub fn name(self) -> Option<&'static str> {
        self.entry().map(|e| e.1)
    }

    /// `(elements per block, bytes per block)`; `(1, 4)` for F32. `None` for unknown and retired
    /// types, whose data size cannot be computed.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        self.entry().filter(|e| e.2 > 0).map(|e| (e.2, e.3))
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "{}", self.0),
        }
    }
}

impl fmt::Debug for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GgmlType({self})")
    }
}

// ---------------------------------------------------------------------------------------------
// Metadata values

/// The type tag of a metadata value, as numbered in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl GgufValueType {
    fn from_u32(v: u32) -> Option<GgufValueType> {
        use GgufValueType::*;
        Some(match v {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        use GgufValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    /// The fewest bytes one value of this type takes in the file: a string is at least its 8-byte
    /// length, an array at least its element type and length.
    fn min_size(self) -> u64 {
        use GgufValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

impl fmt::Display for GgufValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array. Every element has the array's one element type, so the elements are stored
/// unboxed in one typed vector: a 150 000-entry token list is one `Vec<String>`, token types one
/// `Vec<i32>`. Arrays of arrays nest, each inner array with its own element type.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufValue {
    pub fn value_type(&self) -> GgufValueType {
        use GgufValue as V;
        use GgufValueType as T;
        match self {
            V::U8(_) => T::U8,
            V::I8(_) => T::I8,
            V::U16(_) => T::U16,
            V::I16(_) => T::I16,
            V::U32(_) => T::U32,
            V::I32(_) => T::I32,
            V::F32(_) => T::F32,
            V::Bool(_) => T::Bool,
            V::String(_) => T::String,
            V::Array(_) => T::Array,
            V::U64(_) => T::U64,
            V::I64(_) => T::I64,
            V::F64(_) => T::F64,
        }
    }

    /// `"u32"`, `"string"`, or for arrays the element type too: `"array[string]"`.
    pub fn type_name(&self) -> String {
        match self {
            GgufValue::Array(a) => a.type_name(),
            v => v.value_type().name().to_string(),
        }
    }

    /// Any integer, whatever its stored width. Bools and floats are not integers.
    pub fn as_i128(&self) -> Option<i128> {
        use GgufValue as V;
        Some(match *self {
            V::U8(x) => x.into(),
            V::I8(x) => x.into(),
            V::U16(x) => x.into(),
            V::I16(x) => x.into(),
            V::U32(x) => x.into(),
            V::I32(x) => x.into(),
            V::U64(x) => x.into(),
            V::I64(x) => x.into(),
            _ => return None,
        })
    }

    /// Any non-negative integer, whatever its stored width.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|x| u64::try_from(x).ok())
    }

    /// Any integer in the range of i64, whatever its stored width.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|x| i64::try_from(x).ok())
    }

    /// An f32 or f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(x) => Some(x.into()),
            GgufValue::F64(x) => Some(x),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The type and, for scalars, the value, for error messages: `u32 7`, `array[string] of 3`.
    fn describe(&self) -> String {
        use GgufValue as V;
        match self {
            V::String(s) if s.chars().count() > 40 => {
                format!("string {:?}…", s.chars().take(40).collect::<String>())
            }
            V::String(s) => format!("string {s:?}"),
            V::Array(a) => format!("{} of {}", a.type_name(), a.len()),
            V::Bool(b) => format!("bool {b}"),
            V::F32(x) => format!("f32 {x}"),
            V::F64(x) => format!("f64 {x}"),
            v => format!("{} {}", v.value_type(), v.as_i128().unwrap_or_default()),
        }
    }
}

impl GgufArray {
    pub fn elem_type(&self) -> GgufValueType {
        use GgufArray as A;
        use GgufValueType as T;
        match self {
            A::U8(_) => T::U8,
            A::I8(_) => T::I8,
            A::U16(_) => T::U16,
            A::I16(_) => T::I16,
            A::U32(_) => T::U32,
            A::I32(_) => T::I32,
            A::F32(_) => T::F32,
            A::Bool(_) => T::Bool,
            A::String(_) => T::String,
            A::Array(_) => T::Array,
            A::U64(_) => T::U64,
            A::I64(_) => T::I64,
            A::F64(_) => T::F64,
        }
    }

    /// `"array[i32]"`; arrays of arrays are `"array[array]"`.
    pub fn type_name(&self) -> String {
        format!("array[{}]", self.elem_type())
    }

    pub fn len(&self) -> usize {
        use GgufArray as A;
        match self {
            A::U8(v) => v.len(),
            A::I8(v) => v.len(),
            A::U16(v) => v.len(),
            A::I16(v) => v.len(),
            A::U32(v) => v.len(),
            A::I32(v) => v.len(),
            A::F32(v) => v.len(),
            A::Bool(v) => v.len(),
            A::String(v) => v.len(),
            A::Array(v) => v.len(),
            A::U64(v) => v.len(),
            A::I64(v) => v.len(),
            A::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            GgufArray::String(v) => Some(v),
            _ => None,
        }
    }

    /// The elements of an integer array of any width, converted to `T`; `None` when the array is
    /// not of integers or an element does not fit `T`.
    pub fn to_ints<T: TryFrom<i128>>(&self) -> Option<Vec<T>> {
        fn conv<S: Copy + Into<i128>, T: TryFrom<i128>>(v: &[S]) -> Option<Vec<T>> {
            v.iter().map(|&x| T::try_from(x.into()).ok()).collect()
        }
        use GgufArray as A;
        match self {
            A::U8(v) => conv(v),
            A::I8(v) => conv(v),
            A::U16(v) => conv(v),
            A::I16(v) => conv(v),
            A::U32(v) => conv(v),
            A::I32(v) => conv(v),
            A::U64(v) => conv(v),
            A::I64(v) => conv(v),
            _ => None,
        }
    }

    /// The elements of an f32 or f64 array, as f64.
    pub fn to_f64s(&self) -> Option<Vec<f64>> {
        match self {
            GgufArray::F32(v) => Some(v.iter().map(|&x| x.into()).collect()),
            GgufArray::F64(v) => Some(v.clone()),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor infos

/// A tensor's entry in the file's tensor table, validated against the file when it was opened.
#[derive(Clone, Debug)]
pub struct GgufTensorInfo {
    name: String,
    dims: Vec<usize>,
    ggml_type: GgmlType,
    offset: usize,
    n_elements: usize,
    n_bytes: Option<usize>,
}

impl GgufTensorInfo {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The dimensions as the file lists them, fastest-varying first (`dims()[0]` is the row length).
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The shape in PyTorch order (the reverse of [`Self::dims`]): the data is row-major in it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }

    pub fn ggml_type(&self) -> GgmlType {
        self.ggml_type
    }

    /// Offset of the data from the start of the data section, as stored.
    pub fn offset(&self) -> usize {
        self.offset
    }

    pub fn n_elements(&self) -> usize {
        self.n_elements
    }

    /// Size of the data; `None` when the type's block layout is not known.
    pub fn n_bytes(&self) -> Option<usize> {
        self.n_bytes
    }
}

/// A tensor's stored bytes, undecoded, for kernels that consume quantized blocks.
#[derive(Clone, Copy, Debug)]
pub struct RawTensor<'a> {
    pub info: &'a GgufTensorInfo,
    /// Exactly the tensor's data: `info.n_bytes()` bytes, blocks in row-major order.
    pub bytes: &'a [u8],
    /// Where `bytes` starts in the file (and in [`GgufFile::map`]).
    pub file_offset: usize,
}

// ---------------------------------------------------------------------------------------------
// The file

/// An open GGUF file: its metadata, parsed and owned, and its tensors, memory-mapped.
pub struct GgufFile {
    path: PathBuf,
    map: Arc<Mmap>,
    header: Header,
}

/// Everything before the tensor data, parsed and validated against the file length.
#[derive(Debug)]
struct Header {
    version: u32,
    alignment: usize,
    data_offset: usize,
    metadata: Vec<(String, GgufValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
}

/// Generates a required getter and its `opt_` twin, which gives `Ok(None)` for an absent key and
/// an error for a present key of the wrong type.
macro_rules! getters {
    ($( $(#[$doc:meta])* $get:ident, $opt:ident -> $t:ty, $want:expr, $conv:expr; )*) => { $(
        $(#[$doc])*
        pub fn $get(&self, key: &str) -> Result<$t> {
            self.$opt(key)?.ok_or_else(|| self.missing(key))
        }
        #[doc = concat!("Like [`Self::", stringify!($get), "`], but `Ok(None)` when the key is absent.")]
        pub fn $opt(&self, key: &str) -> Result<Option<$t>> {
            self.typed(key, $want, $conv)
        }
    )* };
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; a file truncated under us by another process is the one
        // hazard of every memory-mapped reader and is outside what we can guard against.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let header = parse(path, &map)?;
        Ok(GgufFile { path: path.to_path_buf(), map: Arc::new(map), header })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version, 2 or 3 (they differ only in that 3 allows big-endian files).
    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// `general.alignment`, or 32 when absent.
    pub fn alignment(&self) -> usize {
        self.header.alignment
    }

    /// Where the tensor data section starts in the file.
    pub fn data_offset(&self) -> usize {
        self.header.data_offset
    }

    /// The whole file, mapped; [`RawTensor::file_offset`] indexes into it.
    pub fn map(&self) -> &Arc<Mmap> {
        &self.map
    }

    // -- metadata ----------------------------------------------------------------------------

    /// Every metadata entry, in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.header.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.header.key_index.get(key).map(|&i| &self.header.metadata[i].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.header.key_index.contains_key(key)
    }

    /// The value of a required key, of any type.
    pub fn value(&self, key: &str) -> Result<&GgufValue> {
        self.get(key).ok_or_else(|| self.missing(key))
    }

    /// `general.architecture`, which prefixes the model's own keys (`qwen35.block_count`).
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    fn missing(&self, key: &str) -> Error {
        Error::format(&self.path, format!("missing metadata key `{key}`"))
    }

    fn typed<'s, T>(
        &'s self,
        key: &str,
        want: &str,
        conv: impl FnOnce(&'s GgufValue) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => conv(v).map(Some).ok_or_else(|| {
                Error::format(&self.path, format!("metadata key `{key}` is {}, expected {want}", v.describe()))
            }),
        }
    }

    getters! {
        /// An integer of any stored width that fits u32.
        get_u32, opt_u32 -> u32, "an integer in the range of u32",
            |v| v.as_i128().and_then(|x| u32::try_from(x).ok());
        /// An integer of any stored width that is non-negative.
        get_u64, opt_u64 -> u64, "a non-negative integer", |v| v.as_u64();
        /// An integer of any stored width that is non-negative and fits usize.
        get_usize, opt_usize -> usize, "a non-negative integer",
            |v| v.as_i128().and_then(|x| usize::try_from(x).ok());
        /// An integer of any stored width that fits i32.
        get_i32, opt_i32 -> i32, "an integer in the range of i32",
            |v| v.as_i128().and_then(|x| i32::try_from(x).ok());
        /// An integer of any stored width that fits i64.
        get_i64, opt_i64 -> i64, "an integer in the range of i64", |v| v.as_i64();
        /// An f32, or an f64 rounded to f32.
        get_f32, opt_f32 -> f32, "a float", |v| v.as_f64().map(|x| x as f32);
        /// An f32 or an f64.
        get_f64, opt_f64 -> f64, "a float", |v| v.as_f64();
        get_bool, opt_bool -> bool, "a bool", |v| v.as_bool();
        get_str, opt_str -> &str, "a string", |v| v.as_str();
        get_array, opt_array -> &GgufArray, "an array", |v| v.as_array();
        /// An array of strings, borrowed (`tokenizer.ggml.tokens`, `tokenizer.ggml.merges`).
        get_str_array, opt_str_array -> &[String], "an array of strings",
            |v| v.as_array().and_then(|a| a.as_strings());
        /// An array of integers of any stored width, each fitting i32 (`tokenizer.ggml.token_type`).
        get_i32_array, opt_i32_array -> Vec<i32>, "an array of integers in the range of i32",
            |v| v.as_array().and_then(|a| a.to_ints());
        /// An array of integers of any stored width, each fitting u32.
        get_u32_array, opt_u32_array -> Vec<u32>, "an array of integers in the range of u32",
            |v| v.as_array().and_then(|a| a.to_ints());
        /// An array of non-negative integers of any stored width (per-layer sizes).
        get_usize_array, opt_usize_array -> Vec<usize>, "an array of non-negative integers",
            |v| v.as_array().and_then(|a| a.to_ints());
        /// An array of f32, or of f64 rounded to f32.
        get_f32_array, opt_f32_array -> Vec<f32>, "an array of floats",
            |v| v.as_array().and_then(|a| a.to_f64s()).map(|v| v.into_iter().map(|x| x as f32).collect());
    }

    // -- tensors -----------------------------------------------------------------------------

    /// Every tensor's info, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.header.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.header.tensor_index.get(name).map(|&i| &self.header.tensors[i])
    }

    pub fn contains(&self, name: &str) -> bool {
        self.header.tensor_index.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.header.tensors.iter().map(|t| t.name.as_str())
    }

    fn info(&self, name: &str) -> Result<&GgufTensorInfo> {
        self.tensor_info(name).ok_or_else(|| Error::tensor(name, format!("missing from {}", self.path.display())))
    }

    /// A tensor's bytes and type, undecoded. Fails only for a missing tensor or a type whose
    /// block layout is unknown (so its size is too).
    pub fn raw(&self, name: &str) -> Result<RawTensor<'_>> {
        let info = self.info(name)?;
        let n_bytes = info.n_bytes.ok_or_else(|| {
            Error::tensor(
                name,
                format!("ggml type {} in {} has no known block layout", info.ggml_type, self.path.display()),
            )
        })?;
        let file_offset = self.header.data_offset + info.offset;
        Ok(RawTensor { info, bytes: &self.map[file_offset..file_offset + n_bytes], file_offset })
    }

    /// The tensor as f32, in PyTorch-order shape. F32 is a zero-copy view when aligned; F16,
    /// BF16 and Q8_0 are decoded; any other type is an error naming the tensor and the type.
    pub fn load(&self, name: &str) -> Result<Tensor> {
        let info = self.info(name)?;
        let shape = info.shape();
        let ty = info.ggml_type;
        if ![GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0].contains(&ty) {
            return Err(Error::tensor(
                name,
                format!("ggml type {ty} in {} is not supported (F32, F16, BF16, Q8_0 are)", self.path.display()),
            ));
        }
        let raw = self.raw(name)?;
        let bytes = raw.bytes;
        let data = match ty {
            GgmlType::F32 => {
                if (self.map.as_ptr() as usize + raw.file_offset).is_multiple_of(4) {
                    return Ok(Tensor::mapped(name.to_string(), shape, self.map.clone(), raw.file_offset));
                }
                decode_elems(bytes, 4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
            GgmlType::F16 => decode_elems(bytes, 2, |b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
            GgmlType::BF16 => decode_elems(bytes, 2, |b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            _ => dequantize_q8_0(bytes, info.n_elements),
        };
        Ok(Tensor::owned(name, shape, data))
    }

    /// [`Self::load`], with the shape checked against what the model's config implies.
    pub fn load_shaped(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.load(name)?.expect_shape(shape)
    }

    /// A weight matrix for the products: BF16 stays as stored (a zero-copy view, which the
    /// bf16 kernels widen exactly), every other type as [`Self::load`] gives it.
    pub fn load_matrix(&self, name: &str, shape: &[usize]) -> Result<Matrix> {
        let info = self.info(name)?;
        if info.ggml_type == GgmlType::BF16 {
            let raw = self.raw(name)?;
            if let Some(t) = Bf16Tensor::mapped(name.to_string(), info.shape(), self.map.clone(), raw.file_offset) {
                return Matrix::Bf16(t).expect_shape(shape);
            }
        }
        if info.ggml_type == GgmlType::Q8_0 && shape.len() == 2 {
            let raw = self.raw(name)?;
            if let Some(t) = Q8Tensor::mapped(name.to_string(), info.shape(), self.map.clone(), raw.file_offset) {
                return Matrix::Q8_0(t).expect_shape(shape);
            }
        }
        Ok(Matrix::F32(self.load_shaped(name, shape)?))
    }

    /// A stacked [n][rows][cols] tensor (a mixture-of-experts layer's experts,
    /// `ffn_*_exps`) as its n [rows][cols] matrices, named `NAME[e]`: BF16 and Q8_0 slices stay
    /// as stored (zero-copy views, as [`Self::load_matrix`] keeps a matrix; decoded to f32, the
    /// experts of a Q8_0 Qwen3.5-35B-A3B file would take 3.8 times their bytes), every other
    /// type decoded.
    pub fn load_matrix_stack(&self, name: &str, n: usize, shape: [usize; 2]) -> Result<Vec<Matrix>> {
        let info = self.info(name)?;
        let full = [n, shape[0], shape[1]];
        if info.shape() != full {
            return Err(Error::tensor(name, format!("has shape {:?}, the config implies {:?}", info.shape(), full)));
        }
        let per = shape[0] * shape[1];
        let slice = |e: usize| format!("{name}[{e}]");
        let views = match info.ggml_type {
            GgmlType::BF16 => {
                let base = self.raw(name)?.file_offset;
                (0..n).map(|e| Bf16Tensor::mapped(slice(e), shape.to_vec(), self.map.clone(), base + 2 * per * e).map(Matrix::Bf16)).collect()
            }
            GgmlType::Q8_0 => {
                let base = self.raw(name)?.file_offset;
                (0..n).map(|e| Q8Tensor::mapped(slice(e), shape.to_vec(), self.map.clone(), base + per / 32 * 34 * e).map(Matrix::Q8_0)).collect()
            }
            _ => None,
        };
        if let Some(views) = views {
            return Ok(views);
        }
        let t = self.load_shaped(name, &full)?;
        Ok(t.data().chunks(per).enumerate().map(|(e, d)| Matrix::F32(Tensor::owned(slice(e), shape.to_vec(), d.to_vec()))).collect())
    }
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GgufFile({}, v{}, {} metadata keys, {} tensors)",
            self.path.display(),
            self.header.version,
            self.header.metadata.len(),
            self.header.tensors.len()
        )
    }
}

fn decode_elems(bytes: &[u8], size: usize, f: impl Fn(&[u8]) -> f32 + Sync + Send) -> Vec<f32> {
    bytes.par_chunks_exact(size).with_min_len(PAR_MIN_LEN).map(f).collect()
}

/// Q8_0: blocks of 32 values, each an f16 scale `d` then 32 i8 quants; value = d·q, computed in
/// f32 as ggml does. The caller has checked that `bytes` holds exactly `n / 32` blocks.
fn dequantize_q8_0(bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    out.par_chunks_mut(32).zip(bytes.par_chunks_exact(34)).with_min_len(PAR_MIN_LEN / 32).for_each(|(o, b)| {
        let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
        for (o, &q) in o.iter_mut().zip(&b[2..]) {
            *o = d * f32::from(q as i8);
        }
    });
    out
}

// ---------------------------------------------------------------------------------------------
// Parsing

/// A cursor over the file that never reads past its end. `what` names the thing being read, for
/// the error; it is a closure so that the message is only formatted when something is wrong.
struct Parser<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

type What<'w> = &'w dyn Fn() -> String;

impl<'a> Parser<'a> {
    fn err(&self, msg: impl Into<String>) -> Error {
        Error::format(self.path, msg)
    }

    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: What) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(self.err(format!(
                "truncated: {} needs {n} bytes at offset {}, but the file ends at {}",
                what(),
                self.pos,
                self.buf.len()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: What) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: What) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: What) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Fails unless `count` items of at least `min_size` bytes each can fit in what is left.
    fn check_count(&self, count: u64, min_size: u64, what: What) -> Result<usize> {
        let left = self.left() as u64;
        match count.checked_mul(min_size) {
            Some(need) if need <= left => Ok(count as usize),
            _ => Err(self.err(format!(
                "{} claims {count} entries, more than the {left} bytes left at offset {} can hold \
                 (truncated or corrupt)",
                what(),
                self.pos
            ))),
        }
    }

    fn string(&mut self, what: What) -> Result<String> {
        let len = self.u64(&|| format!("the length of {}", what()))?;
        if len > self.left() as u64 {
            return Err(self.err(format!(
                "truncated: {} claims {len} bytes at offset {}, but only {} remain",
                what(),
                self.pos,
                self.left()
            )));
        }
        let bytes = self.take(len as usize, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.err(format!("{} is not valid UTF-8 ({e})", what()))),
        }
    }

    fn value_type(&self, tag: u32, what: What) -> Result<GgufValueType> {
        GgufValueType::from_u32(tag).ok_or_else(|| self.err(format!("{} has unknown value type {tag}", what())))
    }

    fn bool_byte(&self, b: u8, what: What) -> Result<bool> {
        match b {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(self.err(format!("{} is a bool stored as {b}, not 0 or 1", what()))),
        }
    }

    fn value(&mut self, ty: GgufValueType, key: &str) -> Result<GgufValue> {
        use GgufValueType as T;
        let what = || format!("the value of `{key}`");
        Ok(match ty {
            T::U8 => GgufValue::U8(u8::from_le_bytes(self.array(&what)?)),
            T::I8 => GgufValue::I8(i8::from_le_bytes(self.array(&what)?)),
            T::U16 => GgufValue::U16(u16::from_le_bytes(self.array(&what)?)),
            T::I16 => GgufValue::I16(i16::from_le_bytes(self.array(&what)?)),
            T::U32 => GgufValue::U32(u32::from_le_bytes(self.array(&what)?)),
            T::I32 => GgufValue::I32(i32::from_le_bytes(self.array(&what)?)),
            T::F32 => GgufValue::F32(f32::from_le_bytes(self.array(&what)?)),
            T::U64 => GgufValue::U64(u64::from_le_bytes(self.array(&what)?)),
            T::I64 => GgufValue::I64(i64::from_le_bytes(self.array(&what)?)),
            T::F64 => GgufValue::F64(f64::from_le_bytes(self.array(&what)?)),
            T::Bool => {
                let [b] = self.array(&what)?;
                GgufValue::Bool(self.bool_byte(b, &|| format!("`{key}`"))?)
            }
            T::String => GgufValue::String(self.string(&what)?),
            T::Array => GgufValue::Array(self.gguf_array(key, 0)?),
        })
    }

    /// An array value: element type, length, elements. `depth` counts enclosing arrays.
    fn gguf_array(&mut self, key: &str, depth: usize) -> Result<GgufArray> {
        use GgufValueType as T;
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.err(format!("metadata key `{key}` nests arrays deeper than {MAX_ARRAY_DEPTH} levels")));
        }
        let tag = self.u32(&|| format!("the element type of array `{key}`"))?;
        let ty = self.value_type(tag, &|| format!("an array in `{key}`"))?;
        let len = self.u64(&|| format!("the length of array `{key}`"))?;
        let n = self.check_count(len, ty.min_size(), &|| format!("array `{key}` of {ty}"))?;
        let what = || format!("the elements of array `{key}`");
        fn nums<T, const N: usize>(bytes: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
            bytes
                .chunks_exact(N)
                .map(|c| {
                    let mut a = [0u8; N];
                    a.copy_from_slice(c);
                    f(a)
                })
                .collect()
        }
        // Fixed-size elements: `check_count` has bounded n·size by the bytes left.
        let size = ty.min_size() as usize;
        Ok(match ty {
            T::U8 => GgufArray::U8(self.take(n, &what)?.to_vec()),
            T::I8 => GgufArray::I8(nums(self.take(n, &what)?, i8::from_le_bytes)),
            T::U16 => GgufArray::U16(nums(self.take(n * size, &what)?, u16::from_le_bytes)),
            T::I16 => GgufArray::I16(nums(self.take(n * size, &what)?, i16::from_le_bytes)),
            T::U32 => GgufArray::U32(nums(self.take(n * size, &what)?, u32::from_le_bytes)),
            T::I32 => GgufArray::I32(nums(self.take(n * size, &what)?, i32::from_le_bytes)),
            T::F32 => GgufArray::F32(nums(self.take(n * size, &what)?, f32::from_le_bytes)),
            T::U64 => GgufArray::U64(nums(self.take(n * size, &what)?, u64::from_le_bytes)),
            T::I64 => GgufArray::I64(nums(self.take(n * size, &what)?, i64::from_le_bytes)),
            T::F64 => GgufArray::F64(nums(self.take(n * size, &what)?, f64::from_le_bytes)),
            T::Bool => {
                let bytes = self.take(n, &what)?;
                let mut v = Vec::with_capacity(n);
                for (i, &b) in bytes.iter().enumerate() {
                    v.push(self.bool_byte(b, &|| format!("element {i} of `{key}`"))?);
                }
                GgufArray::Bool(v)
            }
            T::String => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.string(&|| format!("element {i} of array `{key}`"))?);
                }
                GgufArray::String(v)
            }
            T::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.gguf_array(key, depth + 1)?);
                }
                GgufArray::Array(v)
            }
        })
    }
}

fn parse(path: &Path, buf: &[u8]) -> Result<Header> {
    let mut p = Parser { path, buf, pos: 0 };

    let magic = p.take(4, &|| "the magic number".to_string())?;
    if magic != b"GGUF" {
        return Err(p.err(format!("not a GGUF file (it starts with {magic:02x?}, not \"GGUF\")")));
    }
    let version = p.u32(&|| "the version".to_string())?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(Error::unsupported(path, "GGUF version 1 is not supported (2 and 3 are); re-convert the model"))
        }
        v if matches!(v.swap_bytes(), 2 | 3) => {
            return Err(Error::unsupported(path, "big-endian GGUF is not supported"));
        }
        v => return Err(Error::unsupported(path, format!("GGUF version {v} is not supported (2 and 3 are)"))),
    }
    let n_tensors = p.u64(&|| "the tensor count".to_string())?;
    let n_kv = p.u64(&|| "the metadata count".to_string())?;
    // A metadata entry is at least a key length, a type and one byte; a tensor info at least a
    // name length, a dimension count, a type and an offset.
    let n_kv = p.check_count(n_kv, 8 + 4 + 1, &|| "the metadata count".to_string())?;
    p.check_count(n_tensors, 8 + 4 + 4 + 8, &|| "the tensor count".to_string())?;

    let mut metadata = Vec::with_capacity(n_kv);
    let mut key_index = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = p.string(&|| format!("the key of metadata entry {i}"))?;
        let tag = p.u32(&|| format!("the value type of `{key}`"))?;
        let ty = p.value_type(tag, &|| format!("metadata key `{key}`"))?;
        let value = p.value(ty, &key)?;
        if key_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(p.err(format!("metadata key `{key}` appears twice")));
        }
        metadata.push((key, value));
    }

    let alignment = match key_index.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 30 => a as usize,
            _ => {
                return Err(
                    p.err(format!("metadata key `general.alignment` is {}, expected a power of two", v.describe()))
                )
            }
        },
    };

    // Bounded by the check above, but read lazily: the count may still overstate the entries.
    let mut tensors: Vec<GgufTensorInfo> = Vec::new();
    let mut tensor_index = HashMap::new();
    for i in 0..n_tensors {
        let name = p.string(&|| format!("the name of tensor {i}"))?;
        let what = |field: &str| format!("the {field} of tensor `{name}`");
        let n_dims = p.u32(&|| what("dimension count"))? as usize;
        if n_dims > MAX_DIMS {
            return Err(p.err(format!("tensor `{name}` has {n_dims} dimensions, ggml allows at most {MAX_DIMS}")));
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            let d = p.u64(&|| what("dimensions"))?;
            // ggml counts elements in i64.
            match usize::try_from(d) {
                Ok(d) if d <= i64::MAX as usize => dims.push(d),
                _ => return Err(p.err(format!("tensor `{name}` has a dimension of {d}"))),
            }
        }
        let ggml_type = GgmlType(p.u32(&|| what("type"))?);
        let offset = p.u64(&|| what("offset"))?;
        let n_elements = dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as usize)
            .ok_or_else(|| p.err(format!("tensor `{name}` has dimensions {dims:?}, too many elements")))?;
        let offset = usize::try_from(offset)
            .map_err(|_| p.err(format!("tensor `{name}` has data offset {offset}, beyond the end of the file")))?;
        if !offset.is_multiple_of(alignment) {
            return Err(p.err(format!(
                "tensor `{name}` has data offset {offset}, not a multiple of the alignment {alignment}"
            )));
        }
        let n_bytes = match ggml_type.block_layout() {
            None => None,
            Some((block, size)) => {
                let row = dims.first().copied().unwrap_or(1);
                if !row.is_multiple_of(block) {
                    return Err(p.err(format!(
                        "tensor `{name}` has rows of {row} elements, not a whole number of {ggml_type} blocks of {block}"
                    )));
                }
                let n = (n_elements / block)
                    .checked_mul(size)
                    .ok_or_else(|| p.err(format!("tensor `{name}` has dimensions {dims:?}, too many bytes")))?;
                Some(n)
            }
        };
        if tensor_index.insert(name.clone(), tensors.len()).is_some() {
            return Err(p.err(format!("tensor `{name}` appears twice")));
        }
        tensors.push(GgufTensorInfo { name, dims, ggml_type, offset, n_elements, n_bytes });
    }

    let data_offset = p
        .pos
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| p.err("the data section would start beyond the end of the address space"))?;
    if !tensors.is_empty() && data_offset > buf.len() {
        return Err(p.err(format!(
            "truncated: the tensor data would start at offset {data_offset}, but the file ends at {}",
            buf.len()
        )));
    }
    for t in &tensors {
        let end = data_offset.checked_add(t.offset).and_then(|s| s.checked_add(t.n_bytes.unwrap_or(0)));
        match end {
            Some(end) if end <= buf.len() => {}
            _ => {
                return Err(p.err(format!(
                    "truncated: the data of tensor `{}` ({} bytes at data offset {}) runs past the end of the \
                     file ({} bytes, data section at {data_offset})",
                    t.name,
                    t.n_bytes.unwrap_or(0),
                    t.offset,
                    buf.len()
                )))
            }
        }
    }
    // Tensors may be listed in any order, but their data must not overlap.
    let mut by_offset: Vec<&GgufTensorInfo> = tensors.iter().filter(|t| t.n_bytes != Some(0)).collect();
    by_offset.sort_by_key(|t| t.offset);
    for w in by_offset.windows(2) {
        // A tensor of unknown size is only known to take at least one byte.
        let end = w[0].offset + w[0].n_bytes.unwrap_or(1);
        if end > w[1].offset {
            return Err(p.err(format!("the data of tensors `{}` and `{}` overlap", w[0].name, w[1].name)));
        }
    }

    Ok(Header { version, alignment, data_offset, metadata, key_index, tensors, tensor_index })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn fixture_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf")
    }

    fn fixture() -> PathBuf {
        fixture_dir().join("fixture.gguf")
    }

    fn expected() -> Value {
        let text = std::fs::read_to_string(fixture_dir().join("expected.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    fn err_of<T>(r: Result<T>) -> String {
        match r {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    fn parse_err(bytes: &[u8]) -> String {
        err_of(parse(Path::new("bad.gguf"), bytes))
    }

    /// A temporary file that removes itself.
    struct TempFile(PathBuf);
    impl TempFile {
        fn new(tag: &str, bytes: &[u8]) -> TempFile {
            let path = std::env::temp_dir().join(format!("tern-gguf-{}-{tag}.gguf", std::process::id()));
            std::fs::write(&path, bytes).unwrap();
            TempFile(path)
        }
    }
    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// The value as expected.json spells it (see scripts/make_gguf_fixture.py).
    fn value_json(v: &GgufValue) -> Value {
        use GgufValue as V;
        let value = match v {
            V::F32(x) => Value::from(*x as f64),
            V::F64(x) => Value::from(*x),
            V::Bool(b) => Value::from(*b),
            V::String(s) => Value::from(s.as_str()),
            V::U64(x) => Value::from(*x),
            V::Array(a) => return array_json(a),
            v => Value::from(v.as_i64().unwrap()),
        };
        serde_json::json!({ "type": v.type_name(), "value": value })
    }

    fn array_json(a: &GgufArray) -> Value {
        use GgufArray as A;
        let value: Value = match a {
            A::U8(v) => v.clone().into(),
            A::I8(v) => v.iter().map(|&x| x as i64).collect::<Vec<_>>().into(),
            A::U16(v) => v.clone().into(),
            A::I16(v) => v.clone().into(),
            A::U32(v) => v.clone().into(),
            A::I32(v) => v.clone().into(),
            A::U64(v) => v.clone().into(),
            A::I64(v) => v.clone().into(),
            A::F32(v) => v.iter().map(|&x| x as f64).collect::<Vec<_>>().into(),
            A::F64(v) => v.clone().into(),
            A::Bool(v) => v.clone().into(),
            A::String(v) => v.clone().into(),
            A::Array(v) => v.iter().map(array_json).collect::<Vec<_>>().into(),
        };
        serde_json::json!({ "type": a.type_name(), "value": value })
    }

    /// f32 numbers in the JSON are the shortest decimal of an f32 widened to f64; parsing them
    /// can be a bit off in f64, never once rounded back to f32. Rounds them so, in place.
    fn round_f32s(v: &mut Value) {
        let ty = v["type"].as_str().unwrap().to_string();
        match ty.as_str() {
            "f32" => v["value"] = Value::from(v["value"].as_f64().unwrap() as f32 as f64),
            "array[f32]" => {
                for x in v["value"].as_array_mut().unwrap() {
                    *x = Value::from(x.as_f64().unwrap() as f32 as f64);
                }
            }
            "array[array]" => v["value"].as_array_mut().unwrap().iter_mut().for_each(round_f32s),
            _ => {}
        }
    }

    fn bits(t: &Tensor) -> Vec<u64> {
        t.data().iter().map(|x| x.to_bits() as u64).collect()
    }

    fn expected_bits(e: &Value) -> Vec<u64> {
        e["bits"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).collect()
    }

    fn expected_shape(e: &Value) -> Vec<usize> {
        e["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect()
    }

    #[test]
    fn ggml_type_names_and_layouts() {
        assert_eq!(GgmlType::Q8_0.to_string(), "Q8_0");
        assert_eq!(GgmlType::Q4_0.name(), Some("Q4_0"));
        assert_eq!(GgmlType(99).to_string(), "99");
        assert_eq!(GgmlType(99).block_layout(), None);
        assert_eq!(GgmlType(31).to_string(), "Q4_0_4_4");
        assert_eq!(GgmlType(31).block_layout(), None);
        assert_eq!(GgmlType::Q6_K.block_layout(), Some((256, 210)));
        assert_eq!(GgmlType::Q4_K.block_layout(), Some((256, 144)));
        assert_eq!(GgmlType::IQ4_XS.block_layout(), Some((256, 136)));
        assert_eq!(GgmlType::MXFP4.block_layout(), Some((32, 17)));
        for (i, e) in GgmlType::TABLE.iter().enumerate() {
            assert_eq!(e.0 as usize, i, "the table is indexed by type number");
        }
    }

    #[test]
    fn header_and_metadata_match_the_writer() {
        let f = GgufFile::open(&fixture()).unwrap();
        let exp = &expected()["fixture.gguf"];
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), 32);
        assert_eq!(f.data_offset() % 32, 0);
        assert_eq!(f.map().len() as u64, exp["size"].as_u64().unwrap());

        // Every key, in file order, with its type and value.
        let exp_meta = exp["metadata"].as_object().unwrap();
        let keys: Vec<&str> = f.metadata().map(|(k, _)| k).collect();
        let exp_keys: Vec<&str> = exp_meta.keys().map(|k| k.as_str()).collect();
        assert_eq!(keys.len(), exp_keys.len());
        for (key, value) in f.metadata() {
            let mut want = exp_meta.get(key).unwrap_or_else(|| panic!("unexpected key {key}")).clone();
            round_f32s(&mut want);
            assert_eq!(value_json(value), want, "metadata key {key}");
        }
        assert!(exp_keys.iter().all(|k| f.contains_key(k)));
    }

    #[test]
    fn typed_getters() {
        let f = GgufFile::open(&fixture()).unwrap();
        assert_eq!(f.architecture().unwrap(), "qwen35");
        assert_eq!(f.get_u32("qwen35.block_count").unwrap(), 4);
        assert_eq!(f.get_usize("qwen35.block_count").unwrap(), 4);
        assert_eq!(f.get_u64("qwen35.context_length").unwrap(), 1 << 40);
        assert_eq!(f.get_f32("qwen35.rope.freq_base").unwrap(), 1.0e7);
        assert_eq!(f.get_f32("qwen35.attention.layer_norm_rms_epsilon").unwrap(), 1.0e-6);
        assert_eq!(f.get_str("general.description").unwrap(), "héllo, 世界 \u{2014} UTF-8 survives");
        // Integers of every width widen.
        assert_eq!(f.get_usize("test.u8").unwrap(), 200);
        assert_eq!(f.get_i32("test.i8").unwrap(), -100);
        assert_eq!(f.get_u32("test.u16").unwrap(), 60000);
        assert_eq!(f.get_i64("test.i16").unwrap(), -30000);
        assert_eq!(f.get_u32("test.u32").unwrap(), 4_000_000_000);
        assert_eq!(f.get_i32("test.i32").unwrap(), -2_000_000_000);
        assert_eq!(f.get_u64("test.i32_positive").unwrap(), 123456);
        assert_eq!(f.get_u64("test.u64").unwrap(), u64::MAX);
        assert_eq!(f.get_i64("test.i64").unwrap(), -(1i64 << 62));
        assert_eq!(f.get_f64("test.f64").unwrap(), std::f64::consts::E);
        assert_eq!(f.get_f64("test.f32").unwrap(), 0.1f32 as f64);
        assert_eq!(f.get_f32("test.f64").unwrap(), std::f32::consts::E);
        assert!(f.get_bool("test.bool_true").unwrap());
        assert!(!f.get_bool("test.bool_false").unwrap());
        assert_eq!(f.value("test.u8").unwrap(), &GgufValue::U8(200));
        assert_eq!(f.value("test.i8").unwrap().value_type(), GgufValueType::I8);
        // Arrays.
        let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap();
        assert_eq!(tokens.len(), 10);
        assert_eq!(tokens[3], "");
        assert_eq!(tokens[5], "Ġ世界");
        assert_eq!(tokens[7], "\n");
        assert_eq!(f.get_i32_array("tokenizer.ggml.token_type").unwrap(), vec![2, 3, 3, 1, 1, 1, 1, 6, 1, 6]);
        assert_eq!(f.get_str_array("tokenizer.ggml.merges").unwrap(), ["Ġ t", "Ġt he", "h é"]);
        assert_eq!(f.get_array("tokenizer.ggml.token_type").unwrap().elem_type(), GgufValueType::I32);
        assert_eq!(f.get_u32_array("test.array_u32").unwrap(), vec![1, 2, 4_000_000_000]);
        assert_eq!(f.get_usize_array("test.array_u8").unwrap(), vec![0, 1, 127, 255]);
        assert_eq!(f.get_i32_array("test.array_i16").unwrap(), vec![-1, 2, -300]);
        assert_eq!(f.get_f32_array("test.array_f32").unwrap(), vec![0.5, -1.25, 3.0e-8]);
        assert_eq!(f.get_f32_array("test.array_f64").unwrap(), vec![0.1, -2.5]);
        assert_eq!(f.get_array("test.array_u64").unwrap().to_ints::<u64>().unwrap(), vec![0, 1 << 63]);
        match f.get_array("test.nested_array").unwrap() {
            GgufArray::Array(inner) => {
                assert_eq!(inner.len(), 3);
                assert_eq!(inner[1], GgufArray::I32(vec![3, 4, 5]));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(f.get_array("test.nested_twice").unwrap().type_name(), "array[array]");
        // Optional keys.
        assert_eq!(f.opt_u32("qwen35.absent").unwrap(), None);
        assert_eq!(f.opt_str_array("tokenizer.ggml.absent").unwrap(), None);
        assert_eq!(f.opt_bool("test.bool_true").unwrap(), Some(true));
    }

    #[test]
    fn getter_errors_name_the_file_and_key() {
        let path = fixture();
        let f = GgufFile::open(&path).unwrap();
        let p = path.display();
        assert_eq!(err_of(f.get_u32("qwen35.missing_key")), format!("{p}: missing metadata key `qwen35.missing_key`"));
        assert_eq!(err_of(f.value("nope")), format!("{p}: missing metadata key `nope`"));
        assert_eq!(
            err_of(f.get_str("test.u32")),
            format!("{p}: metadata key `test.u32` is u32 4000000000, expected a string")
        );
        assert_eq!(
            err_of(f.get_u64("test.i8")),
            format!("{p}: metadata key `test.i8` is i8 -100, expected a non-negative integer")
        );
        assert_eq!(
            err_of(f.get_u32("test.u64")),
            format!(
                "{p}: metadata key `test.u64` is u64 18446744073709551615, expected an integer in the range of u32"
            )
        );
        assert!(err_of(f.get_i64("test.u64")).contains("`test.u64`"));
        assert!(err_of(f.get_u32("test.f32")).contains("is f32 0.1, expected"));
        assert!(err_of(f.get_u32("test.bool_true")).contains("is bool true"));
        assert_eq!(
            err_of(f.get_str_array("tokenizer.ggml.token_type")),
            format!("{p}: metadata key `tokenizer.ggml.token_type` is array[i32] of 10, expected an array of strings")
        );
        assert!(err_of(f.get_u32_array("test.array_i16")).contains("`test.array_i16` is array[i16] of 3"));
        assert!(err_of(f.get_f32("general.name")).contains("is string \"tern GGUF fixture\", expected a float"));
        // opt_ getters still reject a present key of the wrong type.
        assert!(f.opt_u32("general.name").is_err());
    }

    #[test]
    fn tensors_decode_exactly() {
        let f = GgufFile::open(&fixture()).unwrap();
        let exp = expected();
        let exp_tensors = exp["fixture.gguf"]["tensors"].as_object().unwrap();
        let mut names: Vec<&str> = f.names().collect();
        names.sort();
        let mut exp_names: Vec<&str> = exp_tensors.keys().map(|k| k.as_str()).collect();
        exp_names.sort();
        assert_eq!(names, exp_names);
        for (name, e) in exp_tensors {
            let info = f.tensor_info(name).unwrap();
            assert_eq!(info.ggml_type().to_string(), e["ggml_type"].as_str().unwrap(), "{name}");
            assert_eq!(info.shape(), expected_shape(e), "{name}");
            assert_eq!(info.dims(), info.shape().into_iter().rev().collect::<Vec<_>>(), "{name}");
            assert_eq!(info.offset() % 32, 0);
            if info.ggml_type() == GgmlType::Q4_0 {
                continue;
            }
            let t = f.load(name).unwrap();
            assert_eq!(t.shape, expected_shape(e), "{name}");
            assert_eq!(bits(&t), expected_bits(e), "{name}: decoded values differ");
        }
        // GGUF dims are fastest first; the shape is PyTorch order.
        let t = f.tensor_info("blk.0.f32").unwrap();
        assert_eq!(t.dims(), [4, 3, 2]);
        assert_eq!(t.shape(), [2, 3, 4]);
        assert_eq!(f.tensor_info("blk.0.q8_0").unwrap().dims(), [64, 4]);
        // F32 is a view of the map; the rest is decoded.
        assert!(f.load("blk.0.f32").unwrap().is_mapped());
        assert!(f.load("blk.0.bias").unwrap().is_mapped());
        assert!(!f.load("blk.0.q8_0").unwrap().is_mapped());
        assert_eq!(f.load_shaped("blk.0.f16", &[4, 8]).unwrap().len(), 32);
        assert!(err_of(f.load_shaped("blk.0.f16", &[8, 4])).contains("blk.0.f16"));
        // Decoded values hit the special cases the fixture planted.
        let f16t = f.load("blk.0.f16").unwrap();
        assert_eq!(f16t.data()[0].to_bits(), (-0.0f32).to_bits());
        assert_eq!(f16t.data()[1], f32::INFINITY);
        assert_eq!(f16t.data()[3], 65504.0);
        let q8 = f.load("blk.0.q8_0").unwrap();
        assert!(q8.data()[64..96].iter().all(|&x| x == 0.0), "a zero-scale block decodes to zeros");
        let exp_q8 = &exp_tensors["blk.0.q8_0"];
        assert_eq!(q8.data()[2 * 64 + 5], f32::from_bits(expected_bits(exp_q8)[2 * 64 + 5] as u32));
    }

    /// A GGUF file of the given tensors (name, dims fastest first, type, bytes) and no metadata,
    /// each tensor's data at the next multiple of the default alignment.
    fn with_tensors(tensors: &[(&str, Vec<u64>, GgmlType, Vec<u8>)]) -> Vec<u8> {
        let pad = |b: &mut Vec<u8>| b.resize(b.len().next_multiple_of(DEFAULT_ALIGNMENT), 0);
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend(0u64.to_le_bytes());
        let mut offset = 0usize;
        for (name, dims, ty, data) in tensors {
            b.extend((name.len() as u64).to_le_bytes());
            b.extend(name.as_bytes());
            b.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
            b.extend(ty.0.to_le_bytes());
            b.extend((offset as u64).to_le_bytes());
            offset = (offset + data.len()).next_multiple_of(DEFAULT_ALIGNMENT);
        }
        pad(&mut b);
        for (.., data) in tensors {
            b.extend(data);
            pad(&mut b);
        }
        b
    }

    /// A stacked [n][rows][cols] tensor (a MoE layer's experts) splits into n matrices: BF16 and
    /// Q8_0 as views of the stored bytes (slice e the same values as slice e of the decoded
    /// tensor), other types decoded; a stack of another shape is an error naming the tensor.
    #[test]
    fn stacked_matrices_keep_their_stored_type() {
        let bf16_bytes: Vec<u8> = (0..3 * 2 * 16).flat_map(|i| bf16::from_f32(i as f32 * 0.25 - 7.0).to_le_bytes()).collect();
        let q8_bytes: Vec<u8> = (0..2 * 2 * 2)
            .flat_map(|blk| {
                let mut b = f16::from_f32(0.5 + blk as f32).to_le_bytes().to_vec();
                b.extend((0..32).map(|i| ((i * 7 + blk * 13) % 255) as u8));
                b
            })
            .collect();
        let f32_bytes: Vec<u8> = (0..2 * 3 * 4).flat_map(|i| (i as f32 - 3.5).to_le_bytes()).collect();
        let file = TempFile::new(
            "stacks",
            &with_tensors(&[
                ("exps.bf16", vec![16, 2, 3], GgmlType::BF16, bf16_bytes),
                ("exps.q8_0", vec![64, 2, 2], GgmlType::Q8_0, q8_bytes),
                ("exps.f32", vec![4, 3, 2], GgmlType::F32, f32_bytes),
            ]),
        );
        let f = GgufFile::open(&file.0).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let parts = f.load_matrix_stack("exps.bf16", 3, [2, 16]).unwrap();
        let whole = f.load("exps.bf16").unwrap();
        assert_eq!(parts.len(), 3);
        for (e, m) in parts.iter().enumerate() {
            let Matrix::Bf16(t) = m else { panic!("slice {e} of a BF16 stack is not kept as bf16") };
            assert_eq!((t.name.as_str(), t.shape.as_slice()), (format!("exps.bf16[{e}]").as_str(), &[2, 16][..]));
            let got: Vec<f32> = t.data().iter().map(|&b| f32::from_bits((b as u32) << 16)).collect();
            assert_eq!(bits(&got), bits(&whole.data()[32 * e..32 * (e + 1)]), "bf16 slice {e}");
        }
        let parts = f.load_matrix_stack("exps.q8_0", 2, [2, 64]).unwrap();
        let whole = f.load("exps.q8_0").unwrap();
        for (e, m) in parts.iter().enumerate() {
            let Matrix::Q8_0(t) = m else { panic!("slice {e} of a Q8_0 stack is not kept as Q8_0") };
            assert_eq!(t.shape, [2, 64]);
            let got = dequantize_q8_0(t.data(), 128);
            assert_eq!(bits(&got), bits(&whole.data()[128 * e..128 * (e + 1)]), "q8_0 slice {e}");
        }
        let parts = f.load_matrix_stack("exps.f32", 2, [3, 4]).unwrap();
        let whole = f.load("exps.f32").unwrap();
        for (e, m) in parts.iter().enumerate() {
            let Matrix::F32(t) = m else { panic!("slice {e} of an f32 stack is not f32") };
            assert_eq!(bits(t.data()), bits(&whole.data()[12 * e..12 * (e + 1)]), "f32 slice {e}");
        }
        // The wrong count or slice shape, or a missing tensor, is an error naming the tensor.
        for (n, shape) in [(2usize, [2usize, 16usize]), (3, [4, 8]), (6, [1, 16])] {
            assert!(err_of(f.load_matrix_stack("exps.bf16", n, shape)).contains("exps.bf16"), "{n} x {shape:?}");
        }
        assert!(err_of(f.load_matrix_stack("exps.missing", 1, [1, 1])).contains("exps.missing"));
    }

    #[test]
    fn raw_bytes_and_unsupported_types() {
        let path = fixture();
        let f = GgufFile::open(&path).unwrap();
        let file = std::fs::read(&path).unwrap();
        let q8 = f.raw("blk.0.q8_0").unwrap();
        assert_eq!(q8.info.ggml_type(), GgmlType::Q8_0);
        assert_eq!(q8.bytes.len(), 4 * 2 * 34);
        assert_eq!(q8.info.n_bytes(), Some(272));
        assert_eq!(q8.file_offset, f.data_offset() + q8.info.offset());
        assert_eq!(q8.bytes, &file[q8.file_offset..q8.file_offset + 272]);
        // Block 0's scale, decoded by hand, times its first quant is the first value.
        let d = f16::from_le_bytes([q8.bytes[0], q8.bytes[1]]).to_f32();
        assert_eq!(f.load("blk.0.q8_0").unwrap().data()[0], d * f32::from(q8.bytes[2] as i8));

        let q4 = f.raw("blk.0.q4_0").unwrap();
        assert_eq!(q4.info.ggml_type(), GgmlType::Q4_0);
        assert_eq!(q4.info.shape(), [4, 128]);
        assert_eq!(q4.bytes.len(), 16 * 18);
        assert_eq!(
            err_of(f.load("blk.0.q4_0")),
            format!(
                "tensor `blk.0.q4_0`: ggml type Q4_0 in {} is not supported (F32, F16, BF16, Q8_0 are)",
                path.display()
            )
        );
        assert_eq!(err_of(f.load("no.such")), format!("tensor `no.such`: missing from {}", path.display()));
        assert!(f.raw("no.such").is_err());
    }

    #[test]
    fn custom_alignment() {
        let f = GgufFile::open(&fixture_dir().join("aligned64.gguf")).unwrap();
        let exp = &expected()["aligned64.gguf"];
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.get_u32("general.alignment").unwrap(), 64);
        assert_eq!(f.data_offset() % 64, 0);
        for (name, e) in exp["tensors"].as_object().unwrap() {
            let info = f.tensor_info(name).unwrap();
            assert_eq!(info.offset() % 64, 0);
            let t = f.load(name).unwrap();
            assert_eq!(t.shape, expected_shape(e));
            assert_eq!(bits(&t), expected_bits(e), "{name}");
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = std::fs::read(fixture()).unwrap();
        let f = GgufFile::open(&fixture()).unwrap();
        // The fixture has no trailing padding: the last tensor's data ends the file, so every
        // shorter prefix is missing something the reader needs.
        let end = f.tensors().iter().map(|t| f.data_offset() + t.offset() + t.n_bytes().unwrap()).max().unwrap();
        assert_eq!(end, bytes.len());
        for cut in 0..bytes.len() {
            let msg = parse_err(&bytes[..cut]);
            assert!(msg.starts_with("bad.gguf: "), "cut {cut}: {msg}");
        }
        // The same through real files, at a spread of cut points.
        let cuts: Vec<usize> = (0..bytes.len()).step_by(53).chain([1, 4, 8, 23, bytes.len() - 1]).collect();
        for cut in cuts {
            let tmp = TempFile::new(&format!("cut{cut}"), &bytes[..cut]);
            let msg = err_of(GgufFile::open(&tmp.0));
            assert!(msg.starts_with(&format!("{}: ", tmp.0.display())), "cut {cut}: {msg}");
        }
        // Messages say what was cut.
        let at = |needle: &str| bytes.windows(needle.len()).position(|w| w == needle.as_bytes()).unwrap();
        let tokens = at("tokenizer.ggml.tokens");
        let msg = parse_err(&bytes[..tokens + 40]);
        assert!(msg.contains("array `tokenizer.ggml.tokens`"), "{msg}");
        let q8 = f.tensor_info("blk.0.q8_0").unwrap();
        let msg = parse_err(&bytes[..f.data_offset() + q8.offset() + 100]);
        assert!(msg.contains("truncated") && msg.contains("tensor `blk.0.q8_0`"), "{msg}");
        assert!(parse_err(&[]).contains("magic"));
    }

    /// The byte offset `skip` bytes past the end of the key or tensor name `name` (found with its
    /// length prefix, so `test.u8` does not match inside a longer name).
    fn tensor_field(bytes: &[u8], name: &str, skip: usize) -> usize {
        let mut needle = (name.len() as u64).to_le_bytes().to_vec();
        needle.extend(name.as_bytes());
        let pos = bytes.windows(needle.len()).position(|w| w == needle).unwrap();
        pos + needle.len() + skip
    }

    #[test]
    fn corrupt_headers_are_errors() {
        let good = std::fs::read(fixture()).unwrap();
        let patched = |at: usize, with: &[u8]| {
            let mut b = good.clone();
            b[at..at + with.len()].copy_from_slice(with);
            b
        };

        // Magic and version.
        let msg = err_of(GgufFile::open(&TempFile::new("magic", &patched(0, b"GGML")).0));
        assert!(msg.contains("not a GGUF file"), "{msg}");
        assert!(parse(Path::new("v2.gguf"), &patched(4, &2u32.to_le_bytes())).is_ok(), "v2 has v3's layout");
        assert_eq!(
            parse_err(&patched(4, &1u32.to_le_bytes())),
            "bad.gguf: unsupported model: GGUF version 1 is not supported (2 and 3 are); re-convert the model"
        );
        assert!(parse_err(&patched(4, &4u32.to_le_bytes())).contains("GGUF version 4 is not supported"));
        assert!(parse_err(&patched(4, &3u32.to_be_bytes())).contains("big-endian"));

        // Absurd counts and lengths are refused before anything is allocated for them.
        assert!(parse_err(&patched(8, &u64::MAX.to_le_bytes())).contains("the tensor count claims"));
        assert!(parse_err(&patched(16, &(1u64 << 40).to_le_bytes())).contains("the metadata count claims"));
        assert!(parse_err(&patched(24, &u64::MAX.to_le_bytes())).contains("the key of metadata entry 0"));
        let tokens = tensor_field(&good, "tokenizer.ggml.tokens", 8);
        let msg = parse_err(&patched(tokens, &(1u64 << 60).to_le_bytes()));
        assert!(msg.contains("array `tokenizer.ggml.tokens` of string claims 1152921504606846976 entries"), "{msg}");
        let msg = parse_err(&patched(tensor_field(&good, "test.u8", 0), &99u32.to_le_bytes()));
        assert!(msg.contains("metadata key `test.u8` has unknown value type 99"), "{msg}");
        let msg = parse_err(&patched(tensor_field(&good, "test.bool_true", 4), &[2]));
        assert!(msg.contains("`test.bool_true` is a bool stored as 2"), "{msg}");
        let desc = tensor_field(&good, "general.description", 12);
        let msg = parse_err(&patched(desc, &[0xff]));
        assert!(msg.contains("the value of `general.description` is not valid UTF-8"), "{msg}");

        // Tensor infos: name, n_dims (4), dims (8 each), type (4), offset (8).
        let bias_type = tensor_field(&good, "blk.0.bias", 4 + 8);
        let bias_offset = bias_type + 4;
        let offset = u64::from_le_bytes(good[bias_offset..bias_offset + 8].try_into().unwrap());
        let msg = parse_err(&patched(bias_offset, &(offset + 4).to_le_bytes()));
        assert!(msg.contains("tensor `blk.0.bias` has data offset 100, not a multiple of the alignment 32"), "{msg}");
        let msg = parse_err(&patched(bias_offset, &(1u64 << 20).to_le_bytes()));
        assert!(msg.contains("the data of tensor `blk.0.bias`") && msg.contains("runs past the end"), "{msg}");
        let msg = parse_err(&patched(bias_offset, &u64::MAX.to_le_bytes()));
        assert!(msg.contains("tensor `blk.0.bias`"), "{msg}");
        let msg = parse_err(&patched(bias_offset, &0u64.to_le_bytes()));
        assert!(msg.contains("the data of tensors `blk.0.f32` and `blk.0.bias` overlap"), "{msg}");
        let msg = parse_err(&patched(bias_type, &GgmlType::Q8_0.0.to_le_bytes()));
        assert!(
            msg.contains("tensor `blk.0.bias` has rows of 7 elements, not a whole number of Q8_0 blocks of 32"),
            "{msg}"
        );
        let msg = parse_err(&patched(tensor_field(&good, "blk.0.bias", 0), &5u32.to_le_bytes()));
        assert!(msg.contains("tensor `blk.0.bias` has 5 dimensions, ggml allows at most 4"), "{msg}");
        let msg = parse_err(&patched(tensor_field(&good, "blk.0.bias", 4), &u64::MAX.to_le_bytes()));
        assert!(msg.contains("tensor `blk.0.bias` has a dimension of 18446744073709551615"), "{msg}");
        let q4 = tensor_field(&good, "blk.0.q4_0", 0);
        let msg = parse_err(&patched(q4 + 4, &(1u64 << 40).to_le_bytes()));
        assert!(msg.contains("tensor `blk.0.q4_0`"), "{msg}");
        // An unknown type still opens; using the tensor names the type by number.
        let unknown = patched(tensor_field(&good, "blk.0.q4_0", 4 + 16), &99u32.to_le_bytes());
        let tmp = TempFile::new("unknown-type", &unknown);
        let f = GgufFile::open(&tmp.0).unwrap();
        assert!(err_of(f.load("blk.0.q4_0")).contains("ggml type 99 in"));
        assert!(err_of(f.raw("blk.0.q4_0")).contains("ggml type 99 in"));
        assert!(f.load("blk.0.f16").is_ok());

        // Alignment must be a power of two.
        let a64 = std::fs::read(fixture_dir().join("aligned64.gguf")).unwrap();
        let at = tensor_field(&a64, "general.alignment", 4);
        let mut bad = a64.clone();
        bad[at..at + 4].copy_from_slice(&48u32.to_le_bytes());
        assert!(parse_err(&bad).contains("`general.alignment` is u32 48, expected a power of two"));
    }

    #[test]
    fn parallel_decoding_keeps_order() {
        // Large enough to be split across threads; compared with a plain sequential decode.
        let n_blocks = 4 * PAR_MIN_LEN / 32 + 3;
        let bytes: Vec<u8> = (0..n_blocks * 34).map(|i| (i * 7919 % 251) as u8).collect();
        let got = dequantize_q8_0(&bytes, n_blocks * 32);
        let mut want = Vec::with_capacity(n_blocks * 32);
        for b in bytes.chunks_exact(34) {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
            want.extend(b[2..].iter().map(|&q| d * f32::from(q as i8)));
        }
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let got = decode_elems(&bytes, 2, |b| bf16::from_le_bytes([b[0], b[1]]).to_f32());
        let want: Vec<f32> = bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    /// A GGUF file built by hand, for shapes the Python writer will not produce.
    fn handmade(kvs: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend((kvs.len() as u64).to_le_bytes());
        for (key, ty, value) in kvs {
            b.extend((key.len() as u64).to_le_bytes());
            b.extend(key.as_bytes());
            b.extend(ty.to_le_bytes());
            b.extend(value);
        }
        b
    }

    #[test]
    fn handmade_edge_cases() {
        // No tensors, no padding: a valid (if useless) file.
        let f = parse(Path::new("x.gguf"), &handmade(&[("a", 4, 7u32.to_le_bytes().to_vec())])).unwrap();
        assert_eq!(f.metadata[0].1, GgufValue::U32(7));
        // Nesting beyond the limit.
        let mut deep = Vec::new();
        for _ in 0..MAX_ARRAY_DEPTH + 1 {
            deep.extend(9u32.to_le_bytes());
            deep.extend(1u64.to_le_bytes());
        }
        deep.extend(4u32.to_le_bytes());
        deep.extend(0u64.to_le_bytes());
        let msg = parse_err(&handmade(&[("deep", 9, deep)]));
        assert!(msg.contains("metadata key `deep` nests arrays deeper than 8 levels"), "{msg}");
        // Empty arrays are legal (the Python writer refuses to write them).
        let mut empty = 8u32.to_le_bytes().to_vec();
        empty.extend(0u64.to_le_bytes());
        let h = parse(Path::new("x.gguf"), &handmade(&[("e", 9, empty)])).unwrap();
        assert_eq!(h.metadata[0].1, GgufValue::Array(GgufArray::String(vec![])));
        // Duplicate keys.
        let one = 1u8.to_le_bytes().to_vec();
        let msg = parse_err(&handmade(&[("k", 0, one.clone()), ("k", 0, one)]));
        assert!(msg.contains("metadata key `k` appears twice"), "{msg}");
        // A key whose value is cut short names the key.
        let msg = parse_err(&handmade(&[("short", 10, vec![1, 2, 3])]));
        assert!(msg.contains("the value of `short` needs 8 bytes"), "{msg}");
    }
}
