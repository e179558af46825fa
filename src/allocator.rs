//! The allocator of the `weir` binary: mimalloc, asked for alignment only when a type
//! needs more than every mimalloc block has.
//!
//! mimalloc's aligned entry point takes its fast path only while the size's free list
//! holds a block that happens to be aligned; once that list runs empty, a size whose
//! blocks are not a power of two is served by over-allocating in a larger size class,
//! and the emptied list is not refilled from the blocks freed meanwhile. Every mimalloc
//! block is aligned to [`MIN_ALIGN`] already, so a layout asking for no more than that
//! (nearly every one) goes to the plain entry points, which refill the list.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as ffi;

/// The alignment of every mimalloc block of at least this size (`MI_MAX_ALIGN_SIZE`).
const MIN_ALIGN: usize = 16;

/// mimalloc as the global allocator: `#[global_allocator] static A: Allocator = Allocator;`.
pub struct Allocator;

/// Whether a plain block of `size` bytes is aligned to `align`. Blocks smaller than the
/// alignment asked for may be aligned to less.
fn plain(align: usize, size: usize) -> bool {
    align <= MIN_ALIGN && align <= size
}

// SAFETY: each method hands mimalloc's result through unchanged, asking for at least the
// layout's size and alignment; blocks from either entry point are freed by `mi_free`.
unsafe impl GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: mimalloc takes any size and a power-of-two alignment, as a layout has.
        unsafe {
            if plain(layout.align(), layout.size()) {
                ffi::mi_malloc(layout.size()) as *mut u8
            } else {
                ffi::mi_malloc_aligned(layout.size(), layout.align()) as *mut u8
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        unsafe {
            if plain(layout.align(), layout.size()) {
                ffi::mi_zalloc(layout.size()) as *mut u8
            } else {
                ffi::mi_zalloc_aligned(layout.size(), layout.align()) as *mut u8
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from this allocator, so from mimalloc.
        unsafe { ffi::mi_free(ptr as *mut c_void) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator; the new block keeps the alignment.
        unsafe {
            if plain(layout.align(), new_size) {
                ffi::mi_realloc(ptr as *mut c_void, new_size) as *mut u8
            } else {
                ffi::mi_realloc_aligned(ptr as *mut c_void, new_size, layout.align()) as *mut u8
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_have_the_alignment_their_layout_asks_for() {
        let allocator = Allocator;
        for align in [1, 2, 4, 8, 16, 32, 64, 128, 4096] {
            for size in [1usize, 3, 8, 24, 40, 100, 1000, 5000, 70_000] {
                let size = size.max(align);
                let layout = Layout::from_size_align(size, align).expect("layout");
                // SAFETY: a layout of non-zero size; freed with the same layout.
                unsafe {
                    let block = allocator.alloc(layout);
                    assert!(!block.is_null());
                    assert_eq!(block as usize % align, 0, "size {size}, align {align}");
                    block.write_bytes(0xAB, size);
                    let grown = allocator.realloc(block, layout, size * 3);
                    assert_eq!(grown as usize % align, 0, "grown {size}, align {align}");
                    assert_eq!(*grown.add(size - 1), 0xAB, "the contents move along");
                    allocator.dealloc(grown, Layout::from_size_align(size * 3, align).unwrap());
                    let zeroed = allocator.alloc_zeroed(layout);
                    assert_eq!(zeroed as usize % align, 0);
                    assert!((0..size).all(|i| *zeroed.add(i) == 0));
                    allocator.dealloc(zeroed, layout);
                }
            }
        }
    }
}
