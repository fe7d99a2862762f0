//! The key slab: one entry per known key, a free list through vacant entries, and the LRU of
//! evictable keys as an intrusive list whose links sit in a dense array beside the entries, so
//! the eviction walk reads no entry (the victims' are prefetched together afterwards).

use std::borrow::Cow;

use crate::digest::{KeyCodec, Probe, StoredKey};
use crate::error::StoreError;

/// "No entry" in a link field.
pub const NIL: u32 = u32::MAX;
/// `Entry::slot` of a key that has no slot in the arena.
pub const NO_SLOT: u32 = u32::MAX;
/// `Entry::slot` of a batch key the current put is storing; in the LRU like a stored one.
pub const PENDING_SLOT: u32 = u32::MAX - 1;
/// `Link::prev` of a vacant entry, so `validate` can tell vacant entries from live ones.
const VACANT: u32 = u32::MAX - 1;

/// What the store knows about one key, key included, in one cache line; `M` is the store's.
#[derive(Debug)]
#[repr(C, align(64))]
pub struct Entry<M = ()> {
    key: StoredKey,
    /// Reference count; an entry with `refs == 0` is stored (or pending).
    pub refs: u32,
    /// Arena slot, `NO_SLOT`, or `PENDING_SLOT`.
    pub slot: u32,
    /// Scratch for the put in progress (validation counts, batch positions).
    pub mark: u32,
    /// The store's own per-key data; reset to `M::default()` when the entry is created.
    pub meta: M,
}

const _: () = assert!(std::mem::size_of::<Entry>() == 64);
const _: () = assert!(std::mem::size_of::<Entry<u32>>() == 64);

impl<M: Copy + Default> Entry<M> {
    /// Whether this is the entry of `key`, prepared as `probe`.
    #[inline]
    pub fn is_key(&self, key: &str, probe: &Probe) -> bool {
        self.key.matches(key, probe)
    }

    /// Stored, or being stored by the put in progress.
    #[inline]
    pub fn has_slot(&self) -> bool {
        self.slot != NO_SLOT
    }

    /// Stored and unreferenced: exactly the entries the LRU holds.
    #[inline]
    pub fn is_evictable(&self) -> bool {
        self.has_slot() && self.refs == 0
    }
}

/// LRU neighbours (`NIL` at the ends; a vacant entry has `prev == VACANT`, `next` the free list).
#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
}

/// Entries in a `Vec`, addressed by `u32` index, with a dense link array beside them.
#[derive(Debug)]
pub struct Slab<M = ()> {
    /// The interned key prefixes and the hasher (every entry's key reads through it).
    pub codec: KeyCodec,
    entries: Vec<Entry<M>>,
    links: Vec<Link>,
    free_head: u32,
    live: usize,
    lru_head: u32,
    lru_tail: u32,
    lru_len: usize,
}

impl Default for Slab {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

impl Slab {
    /// An empty slab of the fixed store's layout with room for `capacity` entries.
    pub fn with_capacity(capacity: usize) -> Self {
        Self::with_room(capacity)
    }
}

impl<M: Copy + Default> Slab<M> {
    /// An empty slab of any layout with room for `capacity` entries.
    pub fn with_room(capacity: usize) -> Self {
        Self {
            codec: KeyCodec::default(),
            entries: Vec::with_capacity(capacity),
            links: Vec::with_capacity(capacity),
            free_head: NIL,
            live: 0,
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
        }
    }

    /// An empty slab with address space for `capacity` entries, or what it can get (down to 2^20).
    pub fn with_reserve(capacity: usize) -> Result<Self, StoreError> {
        let mut slab = Self::with_room(0);
        if slab.try_reserve(capacity).is_err() {
            slab = Self::with_room(0);
            slab.try_reserve(capacity.min(1 << 20))?;
        }
        Ok(slab)
    }

    /// Makes room for `additional` more entries, so that inserting them never allocates.
    pub fn try_reserve(&mut self, additional: usize) -> Result<(), StoreError> {
        let refused = |what| StoreError::OutOfMemory {
            what,
            bytes: additional.saturating_mul(std::mem::size_of::<Entry<M>>()),
        };
        // Room in the free list counts: a put's new keys take vacant entries first.
        let fresh = additional.saturating_sub(self.entries.len() - self.live);
        self.entries.try_reserve(fresh).map_err(|_| refused("key entries"))?;
        self.links.try_reserve(fresh).map_err(|_| refused("key links"))?;
        Ok(())
    }

    /// Commits the first `count` entries and links now, on huge pages, so no put faults on them.
    pub fn commit(&mut self, count: usize) {
        fn spare<T>(v: &mut Vec<T>, count: usize) -> (*const u8, usize) {
            let wanted = count.saturating_sub(v.len());
            let spare = v.spare_capacity_mut();
            let n = spare.len().min(wanted);
            (spare.as_ptr().cast(), n * std::mem::size_of::<T>())
        }
        for (start, len) in [spare(&mut self.entries, count), spare(&mut self.links, count)] {
            crate::arena::advise_huge_pages(start, len);
            crate::arena::commit_pages(start, len);
        }
    }

    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Whether `idx` is a live entry.
    pub fn is_live(&self, idx: u32) -> bool {
        self.links.get(idx as usize).is_some_and(|l| l.prev != VACANT)
    }

    /// The 32-bit hash the index files entry `idx` under, from its key (cheap for a digest).
    #[inline]
    pub fn hash(&self, idx: u32) -> u32 {
        self.codec.hash_of(&self.entries[idx as usize].key)
    }

    /// Starts loading entry `idx` into cache, so a batch's entries arrive together.
    #[inline]
    pub fn prefetch(&self, idx: u32) {
        #[cfg(target_arch = "x86_64")]
        if let Some(entry) = self.entries.get(idx as usize) {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let line = std::ptr::from_ref(entry).cast::<i8>();
            // SAFETY: a prefetch never faults or writes; every address lies in the aligned entry.
            unsafe {
                for offset in (0..std::mem::size_of::<Entry<M>>()).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(line.add(offset));
                }
            }
        }
    }

    /// Starts loading the LRU links of `idx` and its neighbours, which a move to the tail rewrites.
    #[inline]
    pub fn prefetch_lru_neighbourhood(&self, idx: u32) {
        #[cfg(target_arch = "x86_64")]
        if let Some(link) = self.links.get(idx as usize) {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            for neighbour in [link.prev, link.next] {
                if let Some(other) = self.links.get(neighbour as usize) {
                    // SAFETY: a prefetch never faults or writes; the address is in `links`.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(other).cast::<i8>()) };
                }
            }
        }
    }

    /// Starts loading the LRU links of entry `idx`.
    #[inline]
    pub fn prefetch_links(&self, idx: u32) {
        #[cfg(target_arch = "x86_64")]
        if let Some(link) = self.links.get(idx as usize) {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            // SAFETY: a prefetch never faults or writes; the address is an element of `links`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(link).cast::<i8>()) };
        }
    }

    pub fn lru_len(&self) -> usize {
        self.lru_len
    }

    /// Oldest evictable entry, or `NIL`.
    pub fn lru_head(&self) -> u32 {
        self.lru_head
    }

    /// Newest evictable entry, or `NIL`.
    pub fn lru_tail(&self) -> u32 {
        self.lru_tail
    }

    /// The entry after `idx` in LRU order, or `NIL`.
    #[inline]
    pub fn lru_next(&self, idx: u32) -> u32 {
        self.links[idx as usize].next
    }

    /// The text of entry `idx`'s key (made afresh for a key held as a digest).
    pub fn key(&self, idx: u32) -> Cow<'_, str> {
        self.key_of(&self[idx])
    }

    /// The text of `entry`'s key, an entry of this slab.
    pub fn key_of<'a>(&'a self, entry: &'a Entry<M>) -> Cow<'a, str> {
        self.codec.text(&entry.key)
    }

    /// Creates an unreferenced entry for `key` (no slot, not in the LRU) and returns its index.
    pub fn insert(&mut self, key: &str, probe: &Probe) -> u32 {
        let stored = KeyCodec::store(key, probe);
        self.codec.hold(&stored, probe);
        self.live += 1;
        let unlinked = Link { prev: NIL, next: NIL };
        if self.free_head == NIL {
            let idx = u32::try_from(self.entries.len()).expect("more than 2^32 keys");
            assert!(idx < VACANT, "more than 2^32 keys");
            let meta = M::default();
            self.entries.push(Entry { key: stored, refs: 0, slot: NO_SLOT, mark: 0, meta });
            self.links.push(unlinked);
            return idx;
        }
        let idx = self.free_head;
        let i = idx as usize;
        debug_assert_eq!(self.links[i].prev, VACANT);
        self.free_head = self.links[i].next;
        self.links[i] = unlinked;
        let entry = &mut self.entries[i];
        entry.refs = 0;
        entry.slot = NO_SLOT;
        entry.mark = 0;
        entry.meta = M::default();
        entry.key = stored;
        idx
    }

    /// Frees an entry that is not in the LRU.
    pub fn remove(&mut self, idx: u32) {
        let i = idx as usize;
        debug_assert_ne!(self.links[i].prev, VACANT, "double free of entry {idx}");
        let entry = &mut self.entries[i];
        debug_assert!(!entry.is_evictable(), "removing entry {idx} while in the LRU");
        self.codec.release(&std::mem::replace(&mut entry.key, StoredKey::EMPTY));
        entry.slot = NO_SLOT;
        entry.refs = 0;
        self.links[i] = Link { prev: VACANT, next: self.free_head };
        self.free_head = idx;
        self.live -= 1;
    }

    /// Appends an entry that is not in the LRU at its tail (newest).
    #[inline]
    pub fn push_back(&mut self, idx: u32) {
        let tail = self.lru_tail;
        {
            let link = &mut self.links[idx as usize];
            debug_assert!(link.prev == NIL && link.next == NIL && self.lru_head != idx);
            link.prev = tail;
            link.next = NIL;
        }
        if tail == NIL {
            self.lru_head = idx;
        } else {
            self.links[tail as usize].next = idx;
        }
        self.lru_tail = idx;
        self.lru_len += 1;
    }

    /// Takes an entry out of the LRU.
    #[inline]
    pub fn unlink(&mut self, idx: u32) {
        let Link { prev, next } =
            std::mem::replace(&mut self.links[idx as usize], Link { prev: NIL, next: NIL });
        debug_assert!(prev != NIL || self.lru_head == idx, "entry {idx} is not in the LRU");
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.links[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.links[next as usize].prev = prev;
        }
        self.lru_len -= 1;
    }

    /// The LRU neighbours of `idx` (`NIL` at the ends), for `relink`.
    #[inline]
    pub fn lru_neighbours(&self, idx: u32) -> (u32, u32) {
        let link = self.links[idx as usize];
        (link.prev, link.next)
    }

    /// Puts an entry back between neighbours `prev` and `next`: undoes an `unlink`, newest first.
    pub fn relink(&mut self, idx: u32, prev: u32, next: u32) {
        debug_assert!({
            let link = self.links[idx as usize];
            link.prev == NIL && link.next == NIL && self.lru_head != idx
        });
        self.links[idx as usize] = Link { prev, next };
        if prev == NIL {
            debug_assert_eq!(self.lru_head, next, "relink: {prev} and {next} are not neighbours");
            self.lru_head = idx;
        } else {
            debug_assert_eq!(self.links[prev as usize].next, next, "relink: not neighbours");
            self.links[prev as usize].next = idx;
        }
        if next == NIL {
            self.lru_tail = idx;
        } else {
            self.links[next as usize].prev = idx;
        }
        self.lru_len += 1;
    }

    /// Moves an entry that is in the LRU to its tail.
    #[inline]
    pub fn move_to_back(&mut self, idx: u32) {
        if self.lru_tail != idx {
            self.unlink(idx);
            self.push_back(idx);
        }
    }

    /// Iterates the LRU from oldest to newest.
    pub fn lru_iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cursor = self.lru_head;
        std::iter::from_fn(move || {
            if cursor == NIL {
                return None;
            }
            let idx = cursor;
            cursor = self.links[idx as usize].next;
            Some(idx)
        })
    }

    pub fn live_indices(&self) -> impl Iterator<Item = u32> + '_ {
        self.links
            .iter()
            .enumerate()
            .filter(|(_, link)| link.prev != VACANT)
            .map(|(idx, _)| idx as u32)
    }

    /// Checks the free list, the live count, and that the LRU holds exactly the evictable entries.
    pub fn validate(&self) -> Result<(), String> {
        if self.links.len() != self.entries.len() {
            return Err("dense arrays and entries differ in length".into());
        }
        let mut vacant = 0usize;
        let mut cursor = self.free_head;
        while cursor != NIL {
            let link = self.links.get(cursor as usize).ok_or("free list leaves the slab")?;
            if link.prev != VACANT {
                return Err(format!("free list: entry {cursor} is live"));
            }
            vacant += 1;
            if vacant > self.entries.len() {
                return Err("free list has a cycle".into());
            }
            cursor = link.next;
        }
        let marked_vacant = self.links.iter().filter(|l| l.prev == VACANT).count();
        if vacant != marked_vacant || self.entries.len() - vacant != self.live {
            return Err(format!(
                "free list: {vacant} linked, {marked_vacant} vacant, {} live counted for {} entries",
                self.live,
                self.entries.len()
            ));
        }
        let mut seen = 0usize;
        let mut prev = NIL;
        let mut cursor = self.lru_head;
        while cursor != NIL {
            let link = self.links.get(cursor as usize).ok_or("LRU leaves the slab")?;
            if link.prev == VACANT {
                return Err(format!("LRU: entry {cursor} is vacant"));
            }
            if link.prev != prev {
                return Err(format!("LRU: entry {cursor} has a broken back link"));
            }
            let entry = &self.entries[cursor as usize];
            if !entry.is_evictable() {
                return Err(format!(
                    "LRU holds exactly the stored unreferenced keys: {:?} is in it with {} \
                     references",
                    self.key_of(entry),
                    entry.refs
                ));
            }
            seen += 1;
            if seen > self.entries.len() {
                return Err("LRU has a cycle".into());
            }
            prev = cursor;
            cursor = link.next;
        }
        if prev != self.lru_tail || seen != self.lru_len {
            return Err(format!(
                "LRU: tail or length wrong ({seen} linked, {} counted)",
                self.lru_len
            ));
        }
        let evictable =
            self.live_indices().filter(|&idx| self.entries[idx as usize].is_evictable()).count();
        if evictable != seen {
            return Err(format!(
                "LRU holds exactly the stored unreferenced keys: {evictable} evictable, {seen} in \
                 the LRU"
            ));
        }
        self.codec.validate(self.live_indices().map(|idx| &self.entries[idx as usize].key))
    }
}

impl<M> std::ops::Index<u32> for Slab<M> {
    type Output = Entry<M>;

    #[inline]
    fn index(&self, idx: u32) -> &Entry<M> {
        &self.entries[idx as usize]
    }
}

impl<M> std::ops::IndexMut<u32> for Slab<M> {
    #[inline]
    fn index_mut(&mut self, idx: u32) -> &mut Entry<M> {
        &mut self.entries[idx as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::INLINE_KEY_BYTES;

    fn insert(slab: &mut Slab, key: &str) -> u32 {
        let probe = slab.codec.probe_for_insert(key);
        slab.insert(key, &probe)
    }

    #[test]
    fn committed_entries_are_used_as_before() {
        let mut slab: Slab = Slab::with_reserve(100_000).unwrap();
        let capacity = slab.entries.capacity();
        let first = insert(&mut slab, "before");
        slab.commit(100_000);
        // Nothing moved or changed: the same allocation, the same entry.
        assert_eq!(slab.entries.capacity(), capacity);
        assert_eq!(slab.key(first), "before");
        let later: Vec<u32> = (0..1_000).map(|i| insert(&mut slab, &format!("k{i}"))).collect();
        assert_eq!(slab.key(later[999]), "k999");
        assert_eq!(slab.hash(later[7]), slab.codec.probe("k7").hash);
        slab.validate().unwrap();
    }

    fn slab_with(keys: &[&str]) -> (Slab, Vec<u32>) {
        let mut slab = Slab::with_capacity(4);
        let idx = keys
            .iter()
            .map(|k| {
                let i = insert(&mut slab, k);
                slab[i].slot = 0;
                i
            })
            .collect();
        (slab, idx)
    }

    fn order(slab: &Slab) -> Vec<String> {
        slab.lru_iter().map(|i| slab.key(i).into_owned()).collect()
    }

    #[test]
    fn lru_push_unlink_move() {
        let (mut slab, idx) = slab_with(&["a", "b", "c"]);
        for &i in &idx {
            slab.push_back(i);
        }
        assert_eq!(order(&slab), ["a", "b", "c"]);
        slab.move_to_back(idx[0]);
        assert_eq!(order(&slab), ["b", "c", "a"]);
        slab.unlink(idx[2]);
        assert_eq!(order(&slab), ["b", "a"]);
        slab[idx[2]].refs = 1; // referenced: out of the LRU by the invariant
        slab.validate().unwrap();
        slab.move_to_back(idx[0]);
        assert_eq!(order(&slab), ["b", "a"]);
        slab.unlink(idx[1]);
        slab.unlink(idx[0]);
        assert_eq!(slab.lru_len(), 0);
        assert_eq!(slab.lru_head(), NIL);
    }

    #[test]
    fn free_list_reuses_entries() {
        let (mut slab, idx) = slab_with(&["a", "b"]);
        slab[idx[0]].slot = NO_SLOT;
        assert_eq!(slab.key(idx[0]), "a");
        slab.remove(idx[0]);
        assert_eq!(slab.len(), 1);
        let again = insert(&mut slab, "c");
        assert_eq!(again, idx[0]);
        assert_eq!(slab.len(), 2);
        slab[again].refs = 1;
        slab[idx[1]].refs = 1;
        slab.validate().unwrap();
        assert_eq!(slab.live_indices().count(), 2);
    }

    #[test]
    fn default_slab_is_empty() {
        let slab = Slab::default();
        assert_eq!(slab.lru_iter().count(), 0);
        assert_eq!(slab.lru_head(), NIL);
        slab.validate().unwrap();
    }

    #[test]
    fn keys_of_every_form_read_back() {
        let long = "k".repeat(INLINE_KEY_BYTES + 1);
        let exact = "e".repeat(INLINE_KEY_BYTES);
        let digest = format!("vllm-artifact/0/{}", "9f".repeat(32));
        let (slab, idx) = slab_with(&[&long, &exact, "", &digest]);
        assert_eq!(slab.key(idx[0]), long);
        assert_eq!(slab.key(idx[1]), exact);
        assert_eq!(slab.key(idx[2]), "");
        assert_eq!(slab.key(idx[3]), digest);
    }

    #[test]
    fn validate_finds_an_evictable_entry_outside_the_lru() {
        let (slab, _) = slab_with(&["a"]);
        let err = slab.validate().unwrap_err();
        assert!(err.contains("LRU holds exactly the stored unreferenced keys"), "{err}");
    }
}
