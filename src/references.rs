//! Replaying one put's count changes to a victim policy, after the call is applied (Python must
//! not see it half done). A map of running counts keeps it linear: a generation reset releases
//! hundreds of thousands of keys in one put, under the store lock.

use foldhash::{HashMap, HashMapExt};

/// Calls `notify(entry, old, new)` per change (`refs`: the count now), forward or undone.
pub(crate) fn replay<E>(
    retains: &[u32],
    releases: &[u32],
    undone: bool,
    refs: impl Fn(u32) -> u32,
    mut notify: impl FnMut(u32, u32, u32) -> Result<(), E>,
) -> Result<(), E> {
    let mut counts: HashMap<u32, i64> = HashMap::with_capacity(retains.len() + releases.len());
    // Each entry's count where the replay starts: before the call forward, after it when undone.
    let sign = if undone { 1 } else { -1 };
    for &idx in retains {
        *counts.entry(idx).or_insert_with(|| i64::from(refs(idx))) += sign;
    }
    for &idx in releases {
        *counts.entry(idx).or_insert_with(|| i64::from(refs(idx))) -= sign;
    }
    let mut step = |idx: u32, delta: i64| -> Result<(), E> {
        let count = counts.get_mut(&idx).expect("every replayed entry was counted");
        let old = *count;
        *count += delta;
        debug_assert!((0..=i64::from(u32::MAX)).contains(count), "a replayed count left u32");
        notify(idx, old as u32, *count as u32)
    };
    if undone {
        for &idx in releases.iter().rev() {
            step(idx, 1)?;
        }
        for &idx in retains.iter().rev() {
            step(idx, -1)?;
        }
    } else {
        for &idx in retains {
            step(idx, 1)?;
        }
        for &idx in releases {
            step(idx, -1)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::replay;

    fn heard(retains: &[u32], releases: &[u32], undone: bool, now: &[u32]) -> Vec<(u32, u32, u32)> {
        let mut out = Vec::new();
        replay::<()>(
            retains,
            releases,
            undone,
            |i| now[i as usize],
            |i, old, new| {
                out.push((i, old, new));
                Ok(())
            },
        )
        .unwrap();
        out
    }

    #[test]
    fn forward_replays_from_the_count_before_the_call() {
        // Entry 0: 1 -> retain, retain, release -> 2. Entry 1: 0 -> retain, release -> 0.
        let now = [2, 0];
        let got = heard(&[0, 1, 0], &[0, 1], false, &now);
        assert_eq!(got, vec![(0, 1, 2), (1, 0, 1), (0, 2, 3), (0, 3, 2), (1, 1, 0)]);
    }

    #[test]
    fn undone_replays_backwards_from_the_count_after_the_call() {
        // The same call rolled back: counts are the original ones (1 and 0) again.
        let now = [1, 0];
        let got = heard(&[0, 1, 0], &[0, 1], true, &now);
        assert_eq!(got, vec![(1, 0, 1), (0, 2, 3), (0, 3, 2), (1, 1, 0), (0, 2, 1)]);
    }

    #[test]
    fn stops_at_the_first_error() {
        let mut calls = 0;
        let result = replay(
            &[0, 1, 2],
            &[],
            false,
            |_| 1,
            |_, _, _| {
                calls += 1;
                if calls == 2 {
                    Err("policy failed")
                } else {
                    Ok(())
                }
            },
        );
        assert_eq!(result, Err("policy failed"));
        assert_eq!(calls, 2);
    }
}
