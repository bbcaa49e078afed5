//! The page pool: a fixed number of KV pages of `page_size` token slots each.
//!
//! ```text
//!   page 0          pages 1 .. num_pages-1
//!   [null page]     [ owned by PageLists (refcount >= 1) | free list (refcount == 0) ]
//! ```
//! Invariants (checked by `check_integrity` and the property tests):
//! - page 0 is never handed out; padded page-table entries point at it;
//! - a page is on the free list iff its refcount is 0; no page is on the list twice;
//! - `num_free() + pages with refcount > 0 == num_pages - 1`.
//!
//! Pages are handed out from the front of the free list and returned to its back, so the
//! most recently freed pages are reused last: a later prefix cache can still revive them.
//! Ownership is RAII: a [`PageList`] returns its pages when dropped, so no path leaks one.
//! The pool knows nothing about what a page stores (target KV, draft KV, or later a
//! recurrent-state slot): callers size pages, the pool only counts them.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

pub type PageId = u32;
pub const NULL_PAGE: PageId = 0;

#[derive(Debug)]
struct PoolState {
    refcount: Vec<u32>,
    free: VecDeque<PageId>,
}

/// Shared handle to the pool. Cloning shares the same pages.
#[derive(Debug, Clone)]
pub struct PagePool {
    page_size: usize,
    num_pages: usize,
    state: Arc<Mutex<PoolState>>,
}

impl PagePool {
    /// `num_pages` includes the null page, so `num_pages - 1` pages are usable.
    pub fn new(num_pages: usize, page_size: usize) -> Self {
        assert!(num_pages >= 2, "a pool needs the null page and at least one usable page");
        assert!(page_size >= 1, "page_size must be >= 1");
        assert!(num_pages <= u32::MAX as usize, "too many pages");
        let free = (1..num_pages as PageId).collect();
        let state = PoolState { refcount: vec![0; num_pages], free };
        PagePool { page_size, num_pages, state: Arc::new(Mutex::new(state)) }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // The pool is never left half-updated inside a critical section, so a poisoned
        // lock (a panic elsewhere) still guards consistent data.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages including the null page.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    pub fn num_usable(&self) -> usize {
        self.num_pages - 1
    }

    pub fn num_free(&self) -> usize {
        self.lock().free.len()
    }

    /// Pages needed to hold `tokens` token slots.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }

    pub fn refcount(&self, page: PageId) -> u32 {
        self.lock().refcount[page as usize]
    }

    /// An empty page list bound to this pool.
    pub fn empty_list(&self) -> PageList {
        PageList { pool: self.clone(), pages: Vec::new() }
    }

    /// Grow `list` to at least `n` pages. All or nothing: on shortage nothing changes.
    pub fn grow_to(&self, list: &mut PageList, n: usize) -> bool {
        debug_assert!(Arc::ptr_eq(&self.state, &list.pool.state));
        list.grow_to(n)
    }

    /// A second owner of the same pages (copy-on-write sharing for prefix caching or forks).
    pub fn share(&self, list: &PageList) -> PageList {
        let mut st = self.lock();
        for &p in &list.pages {
            st.refcount[p as usize] += 1;
        }
        PageList { pool: self.clone(), pages: list.pages.clone() }
    }

    fn release(&self, pages: &[PageId]) {
        let mut st = self.lock();
        for &p in pages {
            let rc = &mut st.refcount[p as usize];
            assert!(*rc > 0, "page {p} released more often than it was owned");
            *rc -= 1;
            if *rc == 0 {
                st.free.push_back(p);
            }
        }
    }

    /// Free-list order, front first (the next pages to be handed out).
    pub fn free_pages(&self) -> Vec<PageId> {
        self.lock().free.iter().copied().collect()
    }

    /// Checks the pool's own invariants; returns a description of the first violation.
    pub fn check_integrity(&self) -> Result<(), String> {
        let st = self.lock();
        if st.refcount[NULL_PAGE as usize] != 0 {
            return Err("null page is owned".into());
        }
        let mut on_list = vec![false; self.num_pages];
        for &p in &st.free {
            if p == NULL_PAGE {
                return Err("null page is on the free list".into());
            }
            if on_list[p as usize] {
                return Err(format!("page {p} is on the free list twice"));
            }
            on_list[p as usize] = true;
            if st.refcount[p as usize] != 0 {
                return Err(format!("page {p} is free and owned"));
            }
        }
        for (p, (&rc, &free)) in st.refcount.iter().zip(&on_list).enumerate().skip(1) {
            if rc == 0 && !free {
                return Err(format!("page {p} is neither free nor owned (leaked)"));
            }
        }
        Ok(())
    }
}

/// Pages owned by one holder (a request's page table). Dropping it returns the pages.
#[derive(Debug)]
pub struct PageList {
    pool: PagePool,
    pages: Vec<PageId>,
}

impl PageList {
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    pub fn len(&self) -> usize {
        self.pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Token slots covered.
    pub fn capacity(&self) -> usize {
        self.pages.len() * self.pool.page_size
    }

    /// Flat slot index of token position `pos` (page * page_size + offset).
    pub fn slot(&self, pos: usize) -> i64 {
        let bs = self.pool.page_size;
        (self.pages[pos / bs] as i64) * bs as i64 + (pos % bs) as i64
    }

    /// Grow to at least `n` pages from this list's pool. All or nothing.
    pub fn grow_to(&mut self, n: usize) -> bool {
        if self.pages.len() >= n {
            return true;
        }
        let want = n - self.pages.len();
        let mut st = self.pool.lock();
        if st.free.len() < want {
            return false;
        }
        for _ in 0..want {
            let page = st.free.pop_front().expect("checked length");
            debug_assert_eq!(st.refcount[page as usize], 0);
            st.refcount[page as usize] = 1;
            self.pages.push(page);
        }
        true
    }

    /// Return every page to the pool now.
    pub fn clear(&mut self) {
        let pages = std::mem::take(&mut self.pages);
        self.pool.release(&pages);
    }
}

impl Drop for PageList {
    fn drop(&mut self) {
        if !self.pages.is_empty() {
            self.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_page_is_never_handed_out() {
        let pool = PagePool::new(4, 16);
        let mut l = pool.empty_list();
        assert!(pool.grow_to(&mut l, 3));
        assert!(!l.pages().contains(&NULL_PAGE));
        assert!(!pool.grow_to(&mut l, 4), "only 3 usable pages");
        assert_eq!(l.len(), 3, "a failed grow changes nothing");
        pool.check_integrity().unwrap();
    }

    #[test]
    fn drop_returns_pages_and_recently_freed_are_reused_last() {
        let pool = PagePool::new(5, 4);
        let mut a = pool.empty_list();
        let mut b = pool.empty_list();
        assert!(pool.grow_to(&mut a, 2)); // pages 1, 2
        assert!(pool.grow_to(&mut b, 1)); // page 3
        assert_eq!(pool.num_free(), 1);
        drop(a);
        assert_eq!(pool.num_free(), 3);
        // page 4 (never used) comes before the just-freed 1 and 2.
        assert_eq!(pool.free_pages(), vec![4, 1, 2]);
        drop(b);
        assert_eq!(pool.num_free(), 4);
        pool.check_integrity().unwrap();
    }

    #[test]
    fn shared_pages_free_only_when_last_owner_drops() {
        let pool = PagePool::new(3, 2);
        let mut a = pool.empty_list();
        assert!(pool.grow_to(&mut a, 1));
        let page = a.pages()[0];
        let b = pool.share(&a);
        assert_eq!(pool.refcount(page), 2);
        drop(a);
        assert_eq!(pool.refcount(page), 1);
        assert_eq!(pool.num_free(), 1);
        drop(b);
        assert_eq!(pool.num_free(), 2);
        pool.check_integrity().unwrap();
    }

    #[test]
    fn slots_follow_the_page_table() {
        let pool = PagePool::new(8, 4);
        let mut filler = pool.empty_list();
        assert!(pool.grow_to(&mut filler, 2)); // take pages 1, 2
        let mut l = pool.empty_list();
        assert!(pool.grow_to(&mut l, 2)); // pages 3, 4
        assert_eq!(l.slot(0), 12);
        assert_eq!(l.slot(5), 17);
        assert_eq!(l.capacity(), 8);
        assert_eq!(pool.pages_for(9), 3);
    }
}
