//! The byte formats of the fuzz inputs: a reading cursor ([`Input`]) for the targets and its
//! mirror image ([`Encoder`]) for the seed generator.
//!
//! Every number is little-endian. Reading past the end yields zeros, so every byte string is a
//! valid input: the fuzzer never wastes executions on inputs the harness rejects, and a
//! truncated input simply stops early (each target stops when [`Input::is_empty`]).

/// A read cursor over a fuzz input.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    /// A cursor at the start of `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    /// Whether every byte was consumed.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Up to `n` bytes (fewer at the end of the input).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (taken, rest) = self.data.split_at(n.min(self.data.len()));
        self.data = rest;
        taken
    }

    /// The rest of the input.
    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(self.data.len())
    }

    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let taken = self.bytes(N);
        out[..taken.len()].copy_from_slice(taken);
        out
    }

    /// One byte (0 at the end).
    pub fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }

    /// A little-endian `u16`.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }

    /// A little-endian `u32`.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    /// A little-endian `u64`.
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

/// Builds inputs in the format [`Input`] reads (for seeds).
#[derive(Debug, Default, Clone)]
pub struct Encoder {
    out: Vec<u8>,
}

impl Encoder {
    /// An empty input.
    pub fn new() -> Self {
        Encoder::default()
    }

    /// Appends one byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.out.push(v);
        self
    }

    /// Appends a little-endian `u16`.
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// Appends a little-endian `u32`.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// Appends a little-endian `u64`.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// Appends raw bytes.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.out.extend_from_slice(b);
        self
    }

    /// The input built so far.
    pub fn finish(&self) -> Vec<u8> {
        self.out.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoder_output_reads_back_and_the_end_reads_as_zeros() {
        let bytes = Encoder::new()
            .u8(7)
            .u16(0x1234)
            .u32(0xdead_beef)
            .u64(u64::MAX - 1)
            .bytes(b"xy")
            .finish();
        let mut input = Input::new(&bytes);

        assert_eq!(input.u8(), 7);
        assert_eq!(input.u16(), 0x1234);
        assert_eq!(input.u32(), 0xdead_beef);
        assert_eq!(input.u64(), u64::MAX - 1);
        assert_eq!(input.bytes(5), b"xy");
        assert!(input.is_empty());
        assert_eq!(input.u32(), 0);
    }
}
