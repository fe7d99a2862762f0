//! One anonymous memory mapping cut into fixed-size slots.
//!
//! The mapping is made once; the kernel commits its pages on first write, so an arena sized for
//! the worst case costs memory only for the slots that were used.

use std::ptr::NonNull;

use crate::error::StoreError;

/// Fixed-size byte slots in one anonymous mapping.
pub struct Arena {
    base: NonNull<u8>,
    len: usize,
    object_nbytes: usize,
    num_slots: usize,
}

// SAFETY: the arena owns its mapping exclusively; shared access only reads (`&self`), writes need
// `&mut self`, so the usual aliasing rules make it as thread-safe as a `Vec<u8>`.
unsafe impl Send for Arena {}
// SAFETY: see `Send`: `&Arena` gives read-only access.
unsafe impl Sync for Arena {}

impl Arena {
    /// Maps `num_slots * object_nbytes` bytes. Fails cleanly on overflow or when the OS refuses.
    pub fn new(num_slots: usize, object_nbytes: usize) -> Result<Self, StoreError> {
        let len = Self::checked_len(num_slots, object_nbytes)?;
        let base = map_anonymous(len)?;
        Ok(Self { base, len, object_nbytes, num_slots })
    }

    fn checked_len(num_slots: usize, object_nbytes: usize) -> Result<usize, StoreError> {
        num_slots.checked_mul(object_nbytes).filter(|&len| len <= isize::MAX as usize).ok_or(
            StoreError::CapacityTooLarge {
                num_slots: num_slots as u64,
                object_nbytes: object_nbytes as u64,
            },
        )
    }

    /// Number of slots.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Bytes per slot.
    pub fn object_nbytes(&self) -> usize {
        self.object_nbytes
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the arena maps no bytes (never true: a store holds at least one slot).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the mapping, for callers that register it with a device driver.
    pub fn as_ptr(&self) -> *const u8 {
        self.base.as_ptr()
    }

    /// The bytes of one slot.
    #[inline]
    pub fn slot(&self, slot: u32) -> &[u8] {
        let slot = slot as usize;
        assert!(slot < self.num_slots, "slot {slot} out of range");
        // SAFETY: slot < num_slots, so the range lies inside the live mapping of `len` bytes.
        unsafe {
            std::slice::from_raw_parts(
                self.base.as_ptr().add(slot * self.object_nbytes),
                self.object_nbytes,
            )
        }
    }

    /// The bytes of one slot, writable.
    #[inline]
    pub fn slot_mut(&mut self, slot: u32) -> &mut [u8] {
        let slot = slot as usize;
        assert!(slot < self.num_slots, "slot {slot} out of range");
        // SAFETY: in range as in `slot`; `&mut self` makes this the only live reference.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.base.as_ptr().add(slot * self.object_nbytes),
                self.object_nbytes,
            )
        }
    }

    /// Grows the arena to `num_slots` slots, keeping every slot's bytes at its index.
    /// The base address may change.
    pub fn grow(&mut self, num_slots: usize) -> Result<(), StoreError> {
        assert!(num_slots >= self.num_slots, "an arena never shrinks");
        let len = Self::checked_len(num_slots, self.object_nbytes)?;
        // SAFETY: base/len describe our own live mapping; MREMAP_MAYMOVE lets the kernel move it,
        // and we replace `base` with the result before anyone reads it again.
        let moved =
            unsafe { libc::mremap(self.base.as_ptr().cast(), self.len, len, libc::MREMAP_MAYMOVE) };
        if moved == libc::MAP_FAILED {
            return Err(StoreError::ArenaUnavailable { bytes: len, errno: last_errno() });
        }
        self.base = NonNull::new(moved.cast()).expect("mremap returned null");
        self.len = len;
        self.num_slots = num_slots;
        Ok(())
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: base/len describe a mapping we own and nothing borrows it past `drop`.
        let rc = unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
        debug_assert_eq!(rc, 0, "munmap failed");
    }
}

fn map_anonymous(len: usize) -> Result<NonNull<u8>, StoreError> {
    // SAFETY: a fresh private anonymous mapping aliases nothing; we check the result.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            // NORESERVE: an arena sized for the worst case should not fail on overcommit limits
            // for pages it may never touch.
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(StoreError::ArenaUnavailable { bytes: len, errno: last_errno() });
    }
    Ok(NonNull::new(base.cast()).expect("mmap returned null"))
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_disjoint_and_zeroed() {
        let mut arena = Arena::new(4, 3).unwrap();
        assert_eq!(arena.len(), 12);
        assert!(arena.slot(3).iter().all(|&b| b == 0));
        arena.slot_mut(1).copy_from_slice(b"abc");
        arena.slot_mut(2).copy_from_slice(b"xyz");
        assert_eq!(arena.slot(1), b"abc");
        assert_eq!(arena.slot(2), b"xyz");
        assert_eq!(arena.slot(0), b"\0\0\0");
    }

    #[test]
    fn grow_keeps_bytes_at_their_slot() {
        let mut arena = Arena::new(2, 4096).unwrap();
        arena.slot_mut(1).fill(7);
        arena.grow(1000).unwrap();
        assert_eq!(arena.num_slots(), 1000);
        assert!(arena.slot(1).iter().all(|&b| b == 7));
        arena.slot_mut(999).fill(9);
        assert!(arena.slot(999).iter().all(|&b| b == 9));
    }

    #[test]
    fn overflowing_size_is_an_error_not_a_crash() {
        assert!(matches!(Arena::new(usize::MAX / 2, 4), Err(StoreError::CapacityTooLarge { .. })));
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn slot_out_of_range_panics() {
        let arena = Arena::new(2, 8).unwrap();
        let _ = arena.slot(2);
    }
}
