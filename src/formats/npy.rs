//! Writer for NumPy's `.npy` format (version 1.0), float32 little-endian, C order. Written by hand:
//! the format is one short ASCII header, and the embedding output needs nothing else of it.

use std::io::Write;

pub fn write_f32<W: Write>(out: &mut W, shape: &[usize], data: &[f32]) -> std::io::Result<()> {
    assert_eq!(shape.iter().product::<usize>(), data.len(), "npy: shape does not match the data");
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_str = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_str}, }}");
    // Magic (6) + version (2) + header length (2) + header + '\n' is padded to a multiple of 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    out.write_all(b"\x93NUMPY\x01\x00")?;
    out.write_all(&(header.len() as u16).to_le_bytes())?;
    out.write_all(header.as_bytes())?;
    let mut bytes = Vec::with_capacity(data.len() * 4);
    for v in data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    out.write_all(&bytes)
}
