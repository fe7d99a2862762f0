//! What the plane knows of the output it carries. The connector, staging and publication work on
//! rows of bytes and blocks of rows for any auxiliary output vLLM captures; what is routed
//! experts' own (the rows' shape, the keys' namespace, the step's field that holds the rows) is
//! here, behind a sealed trait with one implementation, as the store's `Allocator` is: a second
//! output is a second implementation, not a branch through the plane.

use std::fmt::Write as _;

mod sealed {
    /// Only this module's outputs implement `Capture`: the plane relies on their keys matching
    /// vLLM's byte for byte.
    pub trait Sealed {}

    impl Sealed for super::RoutedExperts {}
}

/// One kind of auxiliary output, as the plane needs it; monomorphized, so no `dyn` call a step.
pub trait Capture: sealed::Sealed + Send + 'static {
    /// The attribute of vLLM's pending step that holds the copied rows.
    const ROWS: &'static str;
    /// vLLM's assertion when a step's rows are not of the capture profile (dtype and shape per
    /// token).
    const PROFILE_CHANGED: &'static str;

    /// Bytes of one token's row.
    fn row_nbytes(shape_per_token: &[usize], itemsize: usize) -> usize;

    /// The prefix of every key made in `generation`; a block's key appends its hash in hex.
    fn key_prefix(generation: i64) -> String;

    /// A block's key: `key_prefix(generation)` and the hash as `hash.hex()` writes it.
    fn key(generation: i64, hash: &[u8]) -> Box<str> {
        let mut key = Self::key_prefix(generation);
        push_hex(&mut key, hash);
        key.into_boxed_str()
    }
}

/// vLLM's routed experts (`RoutedExpertsBuffer`): a token's row is the experts each layer
/// routed it to.
#[derive(Debug, Clone, Copy, Default)]
pub struct RoutedExperts;

impl Capture for RoutedExperts {
    const ROWS: &'static str = "routed_experts";
    const PROFILE_CHANGED: &'static str = "routed-experts capture profile changed";

    /// `prod(shape_per_token) * itemsize`.
    fn row_nbytes(shape_per_token: &[usize], itemsize: usize) -> usize {
        shape_per_token.iter().product::<usize>() * itemsize
    }

    /// `vllm-artifact/<generation>/`.
    fn key_prefix(generation: i64) -> String {
        let mut prefix = String::with_capacity(24);
        let _ = write!(prefix, "vllm-artifact/{generation}/");
        prefix
    }
}

/// vLLM's key for a block hash of routed experts: `vllm-artifact/<generation>/<hash as hex>`.
pub fn key_for(generation: i64, hash: &[u8]) -> Box<str> {
    RoutedExperts::key(generation, hash)
}

/// `hash.hex()`: two lowercase digits a byte, appended (a table, not a format call a byte).
pub(super) fn push_hex(key: &mut String, hash: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    key.reserve(2 * hash.len());
    for &byte in hash {
        key.push(char::from(DIGITS[usize::from(byte >> 4)]));
        key.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_vllms() {
        assert_eq!(&*key_for(3, &[0x00, 0xab, 0x10]), "vllm-artifact/3/00ab10");
        let every: Vec<u8> = (0..=255).collect();
        let hex: String = every.iter().map(|byte| format!("{byte:02x}")).collect();
        assert_eq!(&*key_for(-1, &every), format!("vllm-artifact/-1/{hex}"));
    }

    #[test]
    fn rows_are_the_profiles_bytes() {
        assert_eq!(RoutedExperts::row_nbytes(&[46, 8], 1), 368);
        assert_eq!(RoutedExperts::row_nbytes(&[2, 3], 2), 12);
    }
}
