//! The API server's answer body for `aostore.vllm.transport.answer`: JSON text with its long
//! strings spliced in, built in one allocation.
//!
//! A 16k-token sample's body is about 8.5 MB, nearly all of it one base64 string. Encoding
//! that string to bytes and then joining the pieces would allocate (and page-fault) it twice;
//! here each string's UTF-8 is read where CPython keeps it (an ASCII string's own characters)
//! and copied once into the body.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

/// Bytes copied before they are checked, while still in cache.
const BLOCK: usize = 64 * 1024;

/// Whether `json.dumps(ensure_ascii=False)` writes `bytes` as themselves: no `"`, `\` or
/// control character below 0x20 (the only ones its encoder escapes). Tested from Python
/// (`tests/transport/test_answer.py`: escapes in every 64 KiB block).
fn plain(bytes: &[u8]) -> bool {
    // No early exit inside a chunk, so the compiler can test 64 bytes at a time.
    bytes.chunks(64).all(|chunk| {
        !chunk.iter().fold(false, |bad, &b| bad | (b < 0x20) | (b == b'"') | (b == b'\\'))
    })
}

/// `parts[0] + '"' + parts[1] + '"' + parts[2] + ...` as UTF-8 bytes: the even parts are JSON
/// text, the odd ones strings to splice in quotes. `None` when an odd part would not be
/// written as itself in quotes, or a part has no UTF-8 form: the caller then renders the body
/// its own way.
#[pyfunction]
fn splice_json<'py>(
    py: Python<'py>,
    parts: Vec<Bound<'py, PyString>>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let mut texts = Vec::with_capacity(parts.len());
    for part in &parts {
        match part.to_str() {
            Ok(text) => texts.push(text.as_bytes()),
            Err(_) => return Ok(None),
        }
    }
    let quoted = texts.len() / 2;
    let total = texts.iter().map(|t| t.len()).sum::<usize>() + 2 * quoted;
    // Zeroed first by PyO3 (measured: no dearer than uninitialized bytes; the page faults of
    // the first touch are what costs).
    let mut is_plain = true;
    let body = PyBytes::new_with(py, total, |out| {
        let mut at = 0;
        for (i, text) in texts.iter().enumerate() {
            let spliced = i % 2 == 1;
            if spliced {
                out[at] = b'"';
                at += 1;
            }
            for block in text.chunks(BLOCK) {
                let copy = &mut out[at..at + block.len()];
                copy.copy_from_slice(block);
                at += block.len();
                if spliced && !plain(copy) {
                    is_plain = false;
                    return Ok(());
                }
            }
            if spliced {
                out[at] = b'"';
                at += 1;
            }
        }
        Ok(())
    })?;
    Ok(is_plain.then_some(body))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(splice_json, m)?)
}
