//! Routes widened as they are copied (`aostore.r3`'s trainer layouts): vLLM's uint8 expert ids
//! into a trainer's 1-, 2-, 4- or 8-byte integers, zero-extended, in one pass. The caller has
//! checked every route's range (a uint8 route fits each of those dtypes bit for bit once it
//! does), so this is a copy that writes wider: with streaming stores where the destination is
//! larger than a cache (the trainer reads it later, from another core or after a transfer, and
//! loading the destination's old lines only costs).

/// Widths a route may be widened to, in bytes.
pub const WIDTHS: [usize; 4] = [1, 2, 4, 8];

/// `src`'s bytes zero-extended to `width` bytes each, little-endian, into `dst`.
///
/// # Panics
/// When `width` is not one of [`WIDTHS`] or `dst` is not `src.len() * width` bytes long.
pub fn widen_u8(src: &[u8], dst: &mut [u8], width: usize, streaming: bool) {
    assert!(WIDTHS.contains(&width), "a route is widened to 1, 2, 4 or 8 bytes, not {width}");
    assert_eq!(dst.len(), src.len() * width, "the destination is not the routes widened");
    if width == 1 {
        crate::copy_parts(&[src], dst, streaming);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if width == 2 && streaming && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above; the lengths were checked.
        unsafe { widen_to_2_streaming(src, dst) };
        return;
    }
    widen_plain(src, dst, width);
}

/// The portable loop (the compiler vectorizes each width's body).
fn widen_plain(src: &[u8], dst: &mut [u8], width: usize) {
    match width {
        2 => {
            for (d, &s) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&u16::from(s).to_le_bytes());
            }
        }
        4 => {
            for (d, &s) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&u32::from(s).to_le_bytes());
            }
        }
        _ => {
            for (d, &s) in dst.chunks_exact_mut(8).zip(src) {
                d.copy_from_slice(&u64::from(s).to_le_bytes());
            }
        }
    }
}

/// uint8 to 2 bytes: the destination's 32-byte-aligned middle 16 routes at a time with AVX2
/// (`vpmovzxbw`) and streaming stores, its ends with the plain loop.
///
/// # Safety
/// The CPU must have AVX2; `dst` must be `2 * src.len()` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_to_2_streaming(src: &[u8], dst: &mut [u8]) {
    use std::arch::x86_64::{
        _mm256_cvtepu8_epi16, _mm256_stream_si256, _mm_loadu_si128, _mm_sfence,
    };
    const ROUTES: usize = 16; // a 32-byte store
                              // Routes before the first aligned store (dst is a numpy buffer: 2-byte aligned at least).
    let misaligned = dst.as_ptr().align_offset(32);
    let head = if misaligned % 2 == 0 { (misaligned / 2).min(src.len()) } else { src.len() };
    widen_plain(&src[..head], &mut dst[..2 * head], 2);
    let body = (src.len() - head) / ROUTES * ROUTES;
    let (src_body, dst_body) = (&src[head..head + body], &mut dst[2 * head..2 * (head + body)]);
    for (d, s) in dst_body.chunks_exact_mut(2 * ROUTES).zip(src_body.chunks_exact(ROUTES)) {
        // SAFETY: `s` is 16 readable bytes, `d` 32 writable ones aligned to 32 (`head`); AVX2
        // is the caller's promise.
        unsafe {
            let wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(s.as_ptr().cast()));
            _mm256_stream_si256(d.as_mut_ptr().cast(), wide);
        }
    }
    let tail = head + body;
    widen_plain(&src[tail..], &mut dst[2 * tail..], 2);
    // The streaming stores ordered before any later one.
    _mm_sfence();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model: each byte as a little-endian integer of `width` bytes.
    fn model(src: &[u8], width: usize) -> Vec<u8> {
        src.iter().flat_map(|&s| (u64::from(s).to_le_bytes())[..width].to_vec()).collect()
    }

    #[test]
    fn every_width_and_offset_is_the_model() {
        let src: Vec<u8> =
            (0..5_100u32).map(|i| (i * 37 % 251) as u8 | (0x80 * (i % 2) as u8)).collect();
        for width in WIDTHS {
            for streaming in [false, true] {
                // Every alignment of the destination and length of the routes, near the lanes.
                for shift in 0..8 {
                    for len in [0, 1, 15, 16, 17, 31, 33, 100, 4_096, 4_999] {
                        let routes = &src[shift..shift + len];
                        let mut backing = vec![0xAAu8; routes.len() * width + 64];
                        let at = shift * 2; // keeps the 2-byte alignment numpy gives int16
                        let dst = &mut backing[at..at + routes.len() * width];
                        widen_u8(routes, dst, width, streaming);
                        assert_eq!(
                            dst,
                            &model(routes, width)[..],
                            "w{width} s{streaming} {shift} {len}"
                        );
                        assert!(backing[..at].iter().all(|&b| b == 0xAA), "wrote before");
                        let end = at + routes.len() * width;
                        assert!(backing[end..].iter().all(|&b| b == 0xAA), "wrote past");
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "not the routes widened")]
    fn a_destination_of_another_size_is_refused() {
        widen_u8(&[1, 2, 3], &mut [0; 5], 2, false);
    }

    #[test]
    #[should_panic(expected = "1, 2, 4 or 8 bytes")]
    fn a_width_of_3_is_refused() {
        widen_u8(&[1], &mut [0; 3], 3, false);
    }
}
