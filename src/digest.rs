//! Keys as an entry holds them. vLLM's keys (a shared prefix, 64 hex digits, maybe `/<token>`)
//! are held as an interned prefix number, the 32-byte digest and the tail, so entry and key fit
//! one cache line; other keys are text, inline or on the heap. Prefixes carry vLLM's generation,
//! so they are counted and recycled; a prefix is interned only while no key of it is held as text
//! (`overflowed`), so a key is always looked up in the form it was stored in.

use std::borrow::Cow;
use std::collections::HashMap;
use std::hash::BuildHasher;

use foldhash::fast::FixedState;

/// Bytes of a digest held in binary.
pub const DIGEST_BYTES: usize = 32;
const HEX_DIGITS: usize = 2 * DIGEST_BYTES;
/// Live prefixes a table holds at once (every number but `TEXT`); further ones stay text.
const MAX_PREFIXES: usize = TEXT as usize;
/// Longer prefixes are not interned.
const MAX_PREFIX_BYTES: usize = 256;
/// Text keys up to this many bytes stay inside the entry; longer ones go to the heap.
pub const INLINE_KEY_BYTES: usize = 46;
/// The longest tail after the digest: a `/` and a token index of up to 11 digits.
const TAIL_BYTES: usize = 12;
/// `Probe::prefix` of a key held as text.
const TEXT: u16 = u16::MAX;

/// A key as its entry holds it.
#[derive(Debug)]
pub enum StoredKey {
    /// Interned prefix number, binary digest, and the tail after it.
    Digest { prefix: u16, tail: Tail, digest: [u8; DIGEST_BYTES] },
    /// Text of at most `INLINE_KEY_BYTES` bytes.
    Inline { len: u8, bytes: [u8; INLINE_KEY_BYTES] },
    /// Longer text.
    Heap(Box<str>),
}

impl StoredKey {
    pub const EMPTY: Self = Self::Inline { len: 0, bytes: [0; INLINE_KEY_BYTES] };

    /// Whether this is the key `key` was probed as.
    #[inline]
    pub fn matches(&self, key: &str, probe: &Probe) -> bool {
        match self {
            Self::Digest { prefix, tail, digest } => {
                probe.prefix == *prefix && probe.digest == *digest && probe.tail == *tail
            }
            Self::Inline { len, bytes } => {
                probe.prefix == TEXT && &bytes[..usize::from(*len)] == key.as_bytes()
            }
            Self::Heap(text) => probe.prefix == TEXT && text.as_bytes() == key.as_bytes(),
        }
    }
}

/// The bytes after a key's digest (`len` of them, the rest zero).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tail {
    len: u8,
    bytes: [u8; TAIL_BYTES],
}

impl Tail {
    /// The tail as two words for hashing, its length in the top byte.
    #[inline]
    fn words(&self) -> (u64, u64) {
        let mut wide = [0; 16];
        wide[..TAIL_BYTES].copy_from_slice(&self.bytes);
        wide[15] = self.len;
        let wide = u128::from_le_bytes(wide);
        (wide as u64, (wide >> 64) as u64)
    }
}

/// A key prepared for the table: its hash, and its digest form when it has one.
#[derive(Clone, Copy, Debug)]
pub struct Probe {
    /// The 32-bit hash the index files the key under.
    pub hash: u32,
    prefix: u16,
    /// Text only because the prefix table was full (see `KeyCodec::overflowed`).
    overflowed: bool,
    tail: Tail,
    digest: [u8; DIGEST_BYTES],
}

/// An interned prefix and the number of entries that hold it.
#[derive(Debug)]
struct Prefix {
    text: Box<str>,
    holders: u32,
}

/// The interned prefixes, and the hasher every key's hash comes from.
#[derive(Debug)]
pub struct KeyCodec {
    /// By number; a recycled number's text is empty until it is reused.
    prefixes: Vec<Prefix>,
    numbers: HashMap<Box<[u8]>, u16, FixedState>,
    /// Recycled numbers.
    free: Vec<u16>,
    /// The prefix interned last: vLLM's keys are nearly all of it, so lookups try it first.
    newest: u16,
    /// Entries held as text because the table was full; while any live, nothing is interned (a new
    /// prefix could be theirs, and they would no longer be found).
    overflowed: usize,
    hasher: FixedState,
    keys: [u64; 6],
}

impl Default for KeyCodec {
    fn default() -> Self {
        let hasher = FixedState::default();
        // Odd, so no constant multiplies a word away.
        let keys = std::array::from_fn(|i| hasher.hash_one(i) | 1);
        Self {
            prefixes: Vec::new(),
            numbers: HashMap::with_hasher(FixedState::default()),
            free: Vec::new(),
            newest: TEXT,
            overflowed: 0,
            hasher,
            keys,
        }
    }
}

impl KeyCodec {
    /// `key` as the table looks it up: a prefix not interned leaves it text.
    #[inline]
    pub fn probe(&self, key: &str) -> Probe {
        match split(key) {
            Some((prefix, digest, tail)) => match self.find(prefix) {
                Some(number) => self.digest_probe(number, digest, tail),
                None => self.text_probe(key),
            },
            None => self.text_probe(key),
        }
    }

    /// `key` as the table stores it: its prefix is interned if there is room.
    #[inline]
    pub fn probe_for_insert(&mut self, key: &str) -> Probe {
        match split(key) {
            Some((prefix, digest, tail)) => match self.find(prefix) {
                Some(number) => self.digest_probe(number, digest, tail),
                None => match self.intern(prefix) {
                    Ok(number) => self.digest_probe(number, digest, tail),
                    Err(full) => Probe { overflowed: full, ..self.text_probe(key) },
                },
            },
            None => self.text_probe(key),
        }
    }

    /// Counts an entry that now holds `key`.
    #[inline]
    pub fn hold(&mut self, key: &StoredKey, probe: &Probe) {
        match key {
            StoredKey::Digest { prefix, .. } => self.prefixes[usize::from(*prefix)].holders += 1,
            _ if probe.overflowed => self.overflowed += 1,
            _ => {}
        }
    }

    /// Uncounts an entry that held `key`; a prefix no entry holds is recycled.
    #[inline]
    pub fn release(&mut self, key: &StoredKey) {
        match key {
            StoredKey::Digest { prefix, .. } => {
                let entry = &mut self.prefixes[usize::from(*prefix)];
                entry.holders -= 1;
                if entry.holders == 0 {
                    self.recycle(*prefix);
                }
            }
            _ if self.overflowed > 0 && self.is_overflow(key) => self.overflowed -= 1,
            _ => {}
        }
    }

    /// Whether a text key could have been a digest but for a full table.
    fn is_overflow(&self, key: &StoredKey) -> bool {
        split(&self.text(key)).is_some_and(|(prefix, _, _)| internable(prefix).is_some())
    }

    #[cold]
    fn recycle(&mut self, number: u16) {
        let text = std::mem::take(&mut self.prefixes[usize::from(number)].text);
        self.numbers.remove(text.as_bytes());
        self.free.push(number);
        if self.newest == number {
            self.newest = TEXT;
        }
    }

    /// Live prefixes (for tests).
    pub fn live_prefixes(&self) -> usize {
        self.numbers.len()
    }

    /// Checks each prefix's count of holders against the entries' keys.
    pub fn validate<'a>(&self, keys: impl Iterator<Item = &'a StoredKey>) -> Result<(), String> {
        let mut holders = vec![0u32; self.prefixes.len()];
        let mut overflowed = 0;
        for key in keys {
            match key {
                StoredKey::Digest { prefix, .. } => holders[usize::from(*prefix)] += 1,
                _ if self.is_overflow(key) => overflowed += 1,
                _ => {}
            }
        }
        for (number, (prefix, &counted)) in self.prefixes.iter().zip(&holders).enumerate() {
            let interned = self.numbers.get(prefix.text.as_bytes()) == Some(&(number as u16));
            if prefix.holders != counted || (counted > 0 && !interned) {
                return Err(format!(
                    "every prefix counts its keys: {:?} counts {}, holds {counted}",
                    prefix.text, prefix.holders
                ));
            }
        }
        if overflowed != self.overflowed {
            return Err(format!(
                "every key has one form: {overflowed} text keys overflowed, {} counted",
                self.overflowed
            ));
        }
        Ok(())
    }

    pub fn store(key: &str, probe: &Probe) -> StoredKey {
        if probe.prefix != TEXT {
            let (prefix, tail, digest) = (probe.prefix, probe.tail, probe.digest);
            return StoredKey::Digest { prefix, tail, digest };
        }
        if key.len() <= INLINE_KEY_BYTES {
            let mut bytes = [0; INLINE_KEY_BYTES];
            bytes[..key.len()].copy_from_slice(key.as_bytes());
            StoredKey::Inline { len: key.len() as u8, bytes }
        } else {
            StoredKey::Heap(key.into())
        }
    }

    pub fn text<'a>(&'a self, key: &'a StoredKey) -> Cow<'a, str> {
        match key {
            StoredKey::Digest { prefix, tail, digest } => {
                let prefix = &self.prefixes[usize::from(*prefix)].text;
                let tail = &tail.bytes[..usize::from(tail.len)];
                let mut text = Vec::with_capacity(prefix.len() + HEX_DIGITS + tail.len());
                text.extend_from_slice(prefix.as_bytes());
                for byte in digest {
                    text.extend([HEX[usize::from(byte >> 4)], HEX[usize::from(byte & 0x0F)]]);
                }
                text.extend_from_slice(tail);
                // Cut at ASCII bytes, plus hex digits: UTF-8.
                Cow::Owned(String::from_utf8(text).expect("keys are UTF-8"))
            }
            StoredKey::Inline { len, bytes } => Cow::Borrowed(
                std::str::from_utf8(&bytes[..usize::from(*len)]).expect("keys are UTF-8"),
            ),
            StoredKey::Heap(text) => Cow::Borrowed(text),
        }
    }

    #[inline]
    fn find(&self, prefix: &[u8]) -> Option<u16> {
        match self.prefixes.get(usize::from(self.newest)) {
            Some(newest) if newest.text.as_bytes() == prefix => Some(self.newest),
            _ if self.numbers.is_empty() => None,
            _ => self.numbers.get(prefix).copied(),
        }
    }

    /// A new prefix's number; `Err(true)` when the table is full, `Err(false)` if never interned.
    fn intern(&mut self, prefix: &[u8]) -> Result<u16, bool> {
        let text = internable(prefix).ok_or(false)?;
        if self.overflowed > 0 || (self.free.is_empty() && self.prefixes.len() >= MAX_PREFIXES) {
            return Err(true);
        }
        let number = match self.free.pop() {
            Some(number) => {
                self.prefixes[usize::from(number)].text = text.into();
                number
            }
            None => {
                self.prefixes.push(Prefix { text: text.into(), holders: 0 });
                (self.prefixes.len() - 1) as u16
            }
        };
        self.numbers.insert(prefix.into(), number);
        self.newest = number;
        Ok(number)
    }

    /// A stored key's hash, its probe's: a digest's comes from its words, so no text is made.
    #[inline]
    pub fn hash_of(&self, key: &StoredKey) -> u32 {
        match key {
            StoredKey::Digest { prefix, tail, digest } => self.digest_hash(*prefix, digest, tail),
            StoredKey::Inline { .. } | StoredKey::Heap(_) => self.text_hash(&self.text(key)),
        }
    }

    /// A digest's hash: three independent folded multiplies (wyhash's step), one multiply deep.
    #[inline]
    fn digest_hash(&self, prefix: u16, digest: &[u8; DIGEST_BYTES], tail: &Tail) -> u32 {
        let word = |i: usize| u64::from_le_bytes(digest[i..i + 8].try_into().expect("8 bytes"));
        let (low, high) = tail.words();
        let k = &self.keys;
        let full = mix(word(0) ^ k[0], word(8) ^ k[1])
            ^ mix(word(16) ^ k[2], word(24) ^ k[3])
            ^ mix(low ^ k[4] ^ u64::from(prefix), high ^ k[5]);
        fold(full)
    }

    #[inline]
    fn text_hash(&self, key: &str) -> u32 {
        fold(self.hasher.hash_one(key))
    }

    #[inline]
    fn digest_probe(&self, prefix: u16, digest: [u8; DIGEST_BYTES], tail: Tail) -> Probe {
        let hash = self.digest_hash(prefix, &digest, &tail);
        Probe { hash, prefix, overflowed: false, tail, digest }
    }

    #[inline]
    fn text_probe(&self, key: &str) -> Probe {
        let hash = self.text_hash(key);
        let (tail, digest) = (Tail::default(), [0; DIGEST_BYTES]);
        Probe { hash, prefix: TEXT, overflowed: false, tail, digest }
    }
}

/// The 128-bit product of `a` and `b`, folded to 64 bits.
#[inline]
fn mix(a: u64, b: u64) -> u64 {
    let full = u128::from(a) * u128::from(b);
    (full as u64) ^ ((full >> 64) as u64)
}

#[inline]
fn fold(full: u64) -> u32 {
    (full ^ (full >> 32)) as u32
}

/// A prefix's text, if it may be interned: short enough and whole UTF-8.
fn internable(prefix: &[u8]) -> Option<&str> {
    (prefix.len() <= MAX_PREFIX_BYTES).then(|| std::str::from_utf8(prefix).ok()).flatten()
}

const HEX: &[u8; 16] = b"0123456789abcdef";
/// Prefix, digest and tail of a key ending in 64 lowercase hex digits, or with them before its
/// last `/` and at most `TAIL_BYTES` after; lowercase only, so the text comes back exactly.
#[inline]
fn split(key: &str) -> Option<(&[u8], [u8; DIGEST_BYTES], Tail)> {
    let bytes = key.as_bytes();
    let mut end = bytes.len();
    let mut digest = decode(bytes, end);
    if digest.is_none() {
        end = bytes.iter().rposition(|&b| b == b'/')?;
        if bytes.len() - end > TAIL_BYTES {
            return None;
        }
        digest = decode(bytes, end);
    }
    let digest = digest?;
    let mut tail = Tail { len: (bytes.len() - end) as u8, bytes: [0; TAIL_BYTES] };
    // Routed-expert keys have no tail: skip the copy.
    if end < bytes.len() {
        tail.bytes[..bytes.len() - end].copy_from_slice(&bytes[end..]);
    }
    Some((&bytes[..end - HEX_DIGITS], digest, tail))
}

/// The digest in the 64 bytes before `end`, if lowercase hex; SSE2 16 digits at a time.
#[inline]
fn decode(bytes: &[u8], end: usize) -> Option<[u8; DIGEST_BYTES]> {
    let hex: &[u8; HEX_DIGITS] = bytes.get(end.checked_sub(HEX_DIGITS)?..end)?.try_into().ok()?;
    #[cfg(target_arch = "x86_64")]
    return decode_sse2(hex);
    #[cfg(not(target_arch = "x86_64"))]
    return decode_swar(hex);
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn decode_sse2(hex: &[u8; HEX_DIGITS]) -> Option<[u8; DIGEST_BYTES]> {
    use std::arch::x86_64::{
        __m128i, _mm_and_si128, _mm_cmpgt_epi8, _mm_cmplt_epi8, _mm_loadu_si128, _mm_movemask_epi8,
        _mm_or_si128, _mm_packus_epi16, _mm_set1_epi16, _mm_set1_epi8, _mm_slli_epi16,
        _mm_srli_epi16, _mm_storeu_si128, _mm_sub_epi8,
    };
    let mut digest = [0u8; DIGEST_BYTES];
    // SAFETY: SSE2 is baseline; loads read 16 bytes inside `hex` (64), stores write 16 inside
    // `digest` (32), both unaligned forms.
    unsafe {
        let at = |c: u8| _mm_set1_epi8(c as i8);
        // 16 digits to 16 nibbles, and which lanes were lowercase hex (0x80 and up: negative).
        let nibbles = |i: usize| -> (__m128i, __m128i) {
            let v = _mm_loadu_si128(hex.as_ptr().add(16 * i).cast());
            let digit =
                _mm_and_si128(_mm_cmpgt_epi8(v, at(b'0' - 1)), _mm_cmplt_epi8(v, at(b'9' + 1)));
            let letter =
                _mm_and_si128(_mm_cmpgt_epi8(v, at(b'a' - 1)), _mm_cmplt_epi8(v, at(b'f' + 1)));
            // 'a' is 49 past '0' and means 10: letters take 39 more off.
            let value = _mm_sub_epi8(_mm_sub_epi8(v, at(b'0')), _mm_and_si128(letter, at(39)));
            (value, _mm_or_si128(digit, letter))
        };
        // Each 16-bit lane's two nibbles to one byte, first digit high.
        let pairs = |value: __m128i| {
            let high = _mm_slli_epi16(_mm_and_si128(value, _mm_set1_epi16(0x00FF)), 4);
            _mm_or_si128(high, _mm_srli_epi16(value, 8))
        };
        let mut valid = _mm_set1_epi8(-1);
        for half in 0..2 {
            let (a, ok_a) = nibbles(2 * half);
            let (b, ok_b) = nibbles(2 * half + 1);
            valid = _mm_and_si128(valid, _mm_and_si128(ok_a, ok_b));
            let packed = _mm_packus_epi16(pairs(a), pairs(b));
            _mm_storeu_si128(digest.as_mut_ptr().add(16 * half).cast(), packed);
        }
        (_mm_movemask_epi8(valid) == 0xFFFF).then_some(digest)
    }
}

/// The portable decode (and, on x86_64, the tests' reference for the SSE2 one).
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn decode_swar(hex: &[u8; HEX_DIGITS]) -> Option<[u8; DIGEST_BYTES]> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const EVEN: u64 = 0x00FF_00FF_00FF_00FF;
    let mut digest = [0; DIGEST_BYTES];
    let mut valid = HIGH;
    for (out, chunk) in digest.chunks_exact_mut(4).zip(hex.chunks_exact(8)) {
        let x = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        // Bit 7 of each byte: ASCII and in '0'..='9' or 'a'..='f' (a non-ASCII byte fails itself).
        let at_least = |c: u64| x.wrapping_add((0x80 - c) * ONES) & HIGH;
        let digit = at_least(0x30) & !at_least(0x3A);
        let letter = at_least(0x61) & !at_least(0x67);
        valid &= !x & (digit | letter);
        // A digit's value is its low nibble, a letter's that plus 9 (bit 6 marks letters).
        let nibbles = (x & (0x0F * ONES)) + ((x >> 6) & ONES) * 9;
        let pairs = ((nibbles & EVEN) << 4) | ((nibbles >> 8) & EVEN);
        let packed = (pairs & 0xFF)
            | ((pairs >> 8) & 0xFF00)
            | ((pairs >> 16) & 0xFF_0000)
            | ((pairs >> 24) & 0xFF00_0000);
        out.copy_from_slice(&(packed as u32).to_le_bytes());
    }
    (valid == HIGH).then_some(digest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(codec: &mut KeyCodec, key: &str) -> StoredKey {
        let probe = codec.probe_for_insert(key);
        let stored = KeyCodec::store(key, &probe);
        codec.hold(&stored, &probe);
        assert_eq!(codec.text(&stored), key);
        let again = codec.probe(key);
        assert_eq!(again.hash, probe.hash, "{key:?}");
        assert_eq!(codec.hash_of(&stored), probe.hash, "{key:?}");
        assert!(stored.matches(key, &again), "{key:?}");
        stored
    }

    #[test]
    fn vllm_keys_are_held_as_digests_and_come_back_exactly() {
        let mut codec = KeyCodec::default();
        let hex = "0123456789abcdef".repeat(4);
        let keys = [
            format!("vllm-artifact/0/{hex}"),
            format!("vllm-artifact/ns/{hex}"),
            hex.clone(),
            format!("vllm-logprobs/v1/0/(temperature=1.0, 'top_k': 20)/{hex}/151000"),
            format!("vllm-logprobs/v1/0/(temperature=1.0, 'top_k': 20)/{hex}/16"),
            format!("vllm-logprobs/v1/0/(temperature=1.0, 'top_k': 20)/{hex}/"),
            format!("t/{hex}/{}", "9".repeat(TAIL_BYTES - 1)),
        ];
        for key in &keys {
            assert!(matches!(round_trip(&mut codec, key), StoredKey::Digest { .. }), "{key}");
        }
        assert_eq!(codec.live_prefixes(), 5);
        // Same prefix and digest, other tails: other keys.
        let (a, b) = (codec.probe(&keys[3]), codec.probe(&keys[4]));
        assert!(!KeyCodec::store(&keys[4], &b).matches(&keys[3], &a));
        // Same digest, other prefix: another key.
        let a = codec.probe(&format!("vllm-artifact/0/{hex}"));
        let stored_b = KeyCodec::store("", &codec.probe(&format!("vllm-artifact/ns/{hex}")));
        assert!(!stored_b.matches("", &a));
    }

    #[test]
    fn other_keys_stay_text() {
        let mut codec = KeyCodec::default();
        let upper = format!("p/{}", "ABCDEF0123456789".repeat(4));
        let short = "0123456789abcdef".repeat(3);
        let long = "k".repeat(INLINE_KEY_BYTES + 1);
        let bad_digit = format!("{}g", "0".repeat(63));
        let long_tail = format!("{}/{}", "ab".repeat(32), "1".repeat(TAIL_BYTES));
        let no_slash = format!("{}x1", "ab".repeat(32));
        for key in [
            upper.as_str(),
            &short,
            &long,
            &bad_digit,
            &long_tail,
            &no_slash,
            "",
            "a",
            "é",
            "ab/1",
            "/",
            "short/123",
            &format!("{}é{}", "a".repeat(31), "b".repeat(31)),
            &format!("p/{}\u{7f}{}", "a".repeat(31), "b".repeat(32)),
        ] {
            let stored = round_trip(&mut codec, key);
            assert!(!matches!(stored, StoredKey::Digest { .. }), "{key:?}");
        }
        assert!(matches!(round_trip(&mut codec, &long), StoredKey::Heap(_)));
        assert_eq!(codec.live_prefixes(), 0);
        // A multi-byte character right before the digits is a whole prefix.
        let accented = format!("é{}", "ab".repeat(32));
        assert!(matches!(round_trip(&mut codec, &accented), StoredKey::Digest { .. }));
    }

    #[test]
    fn a_prefix_not_interned_keeps_its_keys_text() {
        let mut codec = KeyCodec::default();
        let hex = "ab".repeat(32);
        let looked_up = codec.probe(&format!("p/{hex}"));
        assert_eq!(looked_up.prefix, TEXT, "a lookup interns nothing");
        for i in 0..MAX_PREFIXES {
            codec.probe_for_insert(&format!("p{i}/{hex}"));
        }
        let key = format!("full/{hex}");
        assert!(matches!(round_trip(&mut codec, &key), StoredKey::Heap(_)));
        let long_prefix = format!("{}{hex}", "x".repeat(MAX_PREFIX_BYTES + 1));
        let mut fresh = KeyCodec::default();
        assert!(matches!(round_trip(&mut fresh, &long_prefix), StoredKey::Heap(_)));
    }

    fn hold(codec: &mut KeyCodec, key: &str) -> StoredKey {
        let probe = codec.probe_for_insert(key);
        let stored = KeyCodec::store(key, &probe);
        codec.hold(&stored, &probe);
        stored
    }

    #[test]
    fn prefixes_no_key_holds_are_recycled_over_ten_thousand_generations() {
        let mut codec = KeyCodec::default();
        let hex = "cd".repeat(32);
        let mut previous: Vec<StoredKey> = Vec::new();
        for generation in 0..=10_000 {
            let keys: Vec<String> =
                (0..3).map(|i| format!("vllm-artifact/{generation}/{i}{}", &hex[1..])).collect();
            let held: Vec<StoredKey> = keys.iter().map(|k| hold(&mut codec, k)).collect();
            for (key, stored) in keys.iter().zip(&held) {
                assert!(matches!(stored, StoredKey::Digest { .. }), "{key}");
                assert_eq!(codec.text(stored), key.as_str());
                assert!(stored.matches(key, &codec.probe(key)));
            }
            // The previous generation's keys go (evicted); this one's stay.
            for stored in previous.drain(..) {
                codec.release(&stored);
            }
            previous = held;
            assert!(codec.live_prefixes() <= 2 && codec.prefixes.len() <= 2, "{generation}");
        }
        codec.validate(previous.iter()).unwrap();
    }

    #[test]
    fn keys_of_hundreds_of_live_generations_are_all_digests() {
        let mut codec = KeyCodec::default();
        let hex = "ef".repeat(32);
        let held: Vec<(String, StoredKey)> = (0..700)
            .map(|generation| {
                let key = format!("vllm-artifact/{generation}/{hex}");
                let stored = hold(&mut codec, &key);
                (key, stored)
            })
            .collect();
        for (key, stored) in &held {
            assert!(matches!(stored, StoredKey::Digest { .. }), "{key}");
            assert!(stored.matches(key, &codec.probe(key)), "{key}");
            assert_eq!(codec.hash_of(stored), codec.probe(key).hash);
        }
        assert_eq!(codec.live_prefixes(), 700);
        codec.validate(held.iter().map(|(_, stored)| stored)).unwrap();
    }

    #[test]
    fn a_full_table_keeps_new_prefixes_text_until_its_overflow_is_gone() {
        let mut codec = KeyCodec::default();
        let hex = "12".repeat(32);
        let mut held: Vec<StoredKey> =
            (0..MAX_PREFIXES).map(|i| hold(&mut codec, &format!("p{i}/{hex}"))).collect();
        let overflow = format!("full/{hex}");
        let stored = hold(&mut codec, &overflow);
        assert!(matches!(stored, StoredKey::Heap(_)));
        // A prefix is freed, but no new prefix may take it while `full/`'s text key lives.
        codec.release(&held.swap_remove(0));
        let other = hold(&mut codec, &format!("other/{hex}"));
        assert!(matches!(other, StoredKey::Heap(_)));
        let probe = codec.probe(&overflow);
        assert!(stored.matches(&overflow, &probe));
        assert_eq!(codec.hash_of(&stored), probe.hash);
        codec.validate(held.iter().chain([&stored, &other])).unwrap();
        codec.validate(held.iter().chain([&stored])).unwrap_err();
        codec.release(&stored);
        codec.release(&other);
        codec.validate(held.iter()).unwrap();
        assert!(matches!(hold(&mut codec, &overflow), StoredKey::Digest { .. }));
    }

    #[test]
    fn digests_decode_as_bytes_do() {
        let mut state = 7u64;
        for _ in 0..1_000 {
            let digest: Vec<u8> = (0..DIGEST_BYTES)
                .map(|_| {
                    state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    (state >> 56) as u8
                })
                .collect();
            let text: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(decode(text.as_bytes(), HEX_DIGITS).unwrap().as_slice(), digest);
            let hex: &[u8; HEX_DIGITS] = text.as_bytes().try_into().unwrap();
            assert_eq!(decode_swar(hex).unwrap().as_slice(), digest);
        }
    }

    #[test]
    fn every_byte_is_decoded_or_refused() {
        for (byte, at) in (0..=255u8).flat_map(|b| [(b, 0), (b, 17), (b, 63)]) {
            let mut text = "f".repeat(HEX_DIGITS).into_bytes();
            text[at] = byte;
            let Ok(key) = String::from_utf8(text) else { continue };
            let digit = byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte);
            assert_eq!(split(&key).is_some(), digit, "{byte}");
            let hex: &[u8; HEX_DIGITS] = key.as_bytes().try_into().unwrap();
            assert_eq!(decode_swar(hex), decode(key.as_bytes(), HEX_DIGITS), "{byte}");
            let tailed = format!("{key}/7");
            assert_eq!(split(&tailed).is_some(), digit, "{byte} before a tail");
        }
    }
}
