//! The page pool: a fixed number of KV pages of `page_size` token slots each, and the
//! prefix cache that lives on its free list.
//!
//! ```text
//!   page 0          pages 1 .. num_pages-1
//!   [null page]     [ owned by PageLists (refcount >= 1) | free list (refcount == 0) ]
//!                     some owned and some free pages are *published* (in the cache index)
//! ```
//! Invariants (checked by `check_integrity` and the property tests):
//! - page 0 is never handed out; padded page-table entries point at it;
//! - a page is on the free list iff its refcount is 0; no page is on the list twice;
//! - `num_free() + pages with refcount > 0 == num_pages - 1`;
//! - the cache index maps a hash to exactly the one page whose metadata carries that hash,
//!   and every page with metadata is in the index.
//!
//! ## The free list is the LRU of the prefix cache
//! Pages are handed out from the front of the free list. A freed page that is published
//! (holds a cached prefix) goes to the back, one that holds nothing reusable to the front, and
//! a request returns its pages last page first, so the pages deepest into a prefix are
//! evicted before their parents. A published page stays on the free list with its hash until
//! it is handed out again: only then is its hash dropped (that is the eviction, least recently
//! freed first). A cache hit revives a free page from the middle of the list in O(1): the
//! list is intrusive and doubly linked (`prev`/`next` per page, the null page as sentinel).
//!
//! ## Hashes and the collision rule
//! A full page's hash is chained: `hash(parent page's hash, this page's token ids)` with a
//! per-pool random seed ([`PagePool::page_hash`]), so equal token prefixes give equal hashes.
//! The hash is only an index, never a proof: every published page stores its own token ids
//! and the *entry id* of its parent (entry ids are unique per publication and never reused).
//! A lookup accepts page `j` only if its stored parent entry is the entry accepted for page
//! `j - 1` (the root for `j = 0`) **and** its stored token ids equal the request's; by
//! induction the whole prefix is equal, so a hash collision can cost a cache miss but never
//! hand out a wrong page. Publishing over an index slot held by a page of other content keeps
//! the slot's page if it is in use (this page stays private) and otherwise drops the old
//! page's hash (it stays free, uncached).
//!
//! Ownership is RAII: a [`PageList`] returns its pages when dropped, so no path leaks one.
//! The pool knows nothing about what a page stores (target KV, draft KV, or later a
//! recurrent-state slot): callers size pages, the pool only counts them.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

pub type PageId = u32;
pub const NULL_PAGE: PageId = 0;

/// Identity of one publication of a page: unique, never reused (a page evicted and
/// published again gets a new one). The parent of a prefix's first page is [`ROOT_ENTRY`].
pub type EntryId = u64;
pub const ROOT_ENTRY: EntryId = 0;

/// The chained page hash: `(seed, parent hash, page tokens) -> hash`.
pub type PageHashFn = fn(u64, u64, &[u32]) -> u64;

/// The default page hash: a multiply-xorshift mix over the parent hash and the token ids,
/// finished with the splitmix64 avalanche. Not cryptographic: lookups verify content exactly
/// (module doc), and the per-pool random seed keeps index slots unpredictable to clients.
pub fn default_page_hash(seed: u64, parent: u64, tokens: &[u32]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = (parent ^ seed).wrapping_mul(K) ^ tokens.len() as u64;
    for &t in tokens {
        h = (h ^ t as u64).wrapping_mul(K);
        h ^= h >> 29;
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 31)
}

/// What a published page is: its hash (its index key), its own entry id, its parent's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheMeta {
    pub hash: u64,
    pub entry: EntryId,
    pub parent: EntryId,
}

/// What `publish` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Publish {
    /// The page is now in the cache under this entry.
    Published(EntryId),
    /// An equal page (same parent entry, same tokens) is already published: the prefix
    /// continues with that entry; this page stays private.
    Duplicate(EntryId),
    /// A page of other content holds the hash and is in use: nothing is published.
    Conflict,
}

/// The index's keys are page hashes already mixed with the pool's random seed: hashing them
/// again would be wasted work on the commit path (and clients cannot aim at buckets).
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

#[derive(Debug)]
struct PoolState {
    refcount: Vec<u32>,
    /// Intrusive doubly linked free list; `prev[NULL_PAGE]` is the back, `next[NULL_PAGE]` the front.
    prev: Vec<PageId>,
    next: Vec<PageId>,
    num_free: usize,
    meta: Vec<Option<CacheMeta>>,
    /// `page_size` token ids per page, valid where `meta` is set.
    tokens: Vec<u32>,
    index: HashMap<u64, PageId, BuildHasherDefault<PassThrough>>,
    next_entry: EntryId,
    seed: u64,
    hash_fn: PageHashFn,
    evictions: u64,
}

impl PoolState {
    fn is_free(&self, p: PageId) -> bool {
        p != NULL_PAGE && self.refcount[p as usize] == 0
    }

    fn link_between(&mut self, p: PageId, before: PageId, after: PageId) {
        self.prev[p as usize] = before;
        self.next[p as usize] = after;
        self.next[before as usize] = p;
        self.prev[after as usize] = p;
        self.num_free += 1;
    }

    fn push_back(&mut self, p: PageId) {
        let last = self.prev[NULL_PAGE as usize];
        self.link_between(p, last, NULL_PAGE);
    }

    fn push_front(&mut self, p: PageId) {
        let first = self.next[NULL_PAGE as usize];
        self.link_between(p, NULL_PAGE, first);
    }

    fn unlink(&mut self, p: PageId) {
        let (a, b) = (self.prev[p as usize], self.next[p as usize]);
        self.next[a as usize] = b;
        self.prev[b as usize] = a;
        self.prev[p as usize] = NULL_PAGE;
        self.next[p as usize] = NULL_PAGE;
        self.num_free -= 1;
    }

    /// Take the front page (least recently freed); its cached content, if any, is evicted.
    fn pop_front(&mut self) -> PageId {
        let p = self.next[NULL_PAGE as usize];
        assert_ne!(p, NULL_PAGE, "pop from an empty free list");
        self.unlink(p);
        if self.uncache(p) {
            self.evictions += 1;
        }
        p
    }

    /// Drop `p`'s hash from the index; true if it had one.
    fn uncache(&mut self, p: PageId) -> bool {
        match self.meta[p as usize].take() {
            Some(m) => {
                let removed = self.index.remove(&m.hash);
                debug_assert_eq!(removed, Some(p));
                true
            }
            None => false,
        }
    }

    fn page_tokens(&self, p: PageId, ps: usize) -> &[u32] {
        &self.tokens[p as usize * ps..(p as usize + 1) * ps]
    }
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
        let n = num_pages;
        // Free list 1, 2, .., n-1 in order, closed through the sentinel (page 0).
        let next = (0..n).map(|p| ((p + 1) % n) as PageId).collect();
        let prev = (0..n).map(|p| ((p + n - 1) % n) as PageId).collect();
        let state = PoolState {
            refcount: vec![0; n],
            prev,
            next,
            num_free: n - 1,
            meta: vec![None; n],
            tokens: vec![0; n * page_size],
            index: HashMap::default(),
            next_entry: ROOT_ENTRY + 1,
            seed: RandomState::new().hash_one(0x5EED_u64),
            hash_fn: default_page_hash,
            evictions: 0,
        };
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

    /// Free pages, cached ones included (a cached free page is evicted when handed out).
    pub fn num_free(&self) -> usize {
        self.lock().num_free
    }

    /// Pages needed to hold `tokens` token slots.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }

    pub fn refcount(&self, page: PageId) -> u32 {
        self.lock().refcount[page as usize]
    }

    /// The page's cache metadata if it is published.
    pub fn cache_meta(&self, page: PageId) -> Option<CacheMeta> {
        self.lock().meta[page as usize]
    }

    /// Published pages (in use or free).
    pub fn num_cached(&self) -> usize {
        self.lock().index.len()
    }

    /// Cached pages dropped from the index because they were handed out again.
    pub fn num_evictions(&self) -> u64 {
        self.lock().evictions
    }

    /// The chained hash of one full page (`parent` is the previous page's hash, or
    /// [`ROOT_ENTRY`] for the first page).
    pub fn page_hash(&self, parent: u64, tokens: &[u32]) -> u64 {
        debug_assert_eq!(tokens.len(), self.page_size);
        let st = self.lock();
        (st.hash_fn)(st.seed, parent, tokens)
    }

    /// Replace the page hash (tests force collisions with a weak one). Only while nothing
    /// is published and no request has hashed its tokens yet.
    #[doc(hidden)]
    pub fn set_hash_fn(&self, f: PageHashFn) {
        let mut st = self.lock();
        assert!(st.index.is_empty(), "set the page hash before anything is published");
        st.hash_fn = f;
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

    /// The longest run of published pages equal to the leading full pages of `tokens`:
    /// `hashes[j]` is the chained hash of page `j` of `tokens`. Each hit is checked exactly
    /// (parent entry and token ids, module doc); the walk stops at the first miss.
    /// Returns `(page, entry)` per hit page. Changes nothing.
    pub fn match_prefix(&self, hashes: &[u64], tokens: &[u32]) -> Vec<(PageId, EntryId)> {
        let ps = self.page_size;
        assert!(tokens.len() >= hashes.len() * ps, "fewer tokens than hashed pages");
        let st = self.lock();
        let mut hits = Vec::new();
        let mut parent = ROOT_ENTRY;
        for (j, h) in hashes.iter().enumerate() {
            let Some(&p) = st.index.get(h) else { break };
            let m = st.meta[p as usize].expect("indexed pages carry metadata");
            if m.parent != parent || st.page_tokens(p, ps) != &tokens[j * ps..(j + 1) * ps] {
                break; // a hash collision, or a page whose parent was evicted
            }
            hits.push((p, m.entry));
            parent = m.entry;
        }
        hits
    }

    /// Publish `page` (owned, full, never written again) under `hash`, child of `parent`.
    pub fn publish(&self, page: PageId, hash: u64, parent: EntryId, tokens: &[u32]) -> Publish {
        let ps = self.page_size;
        assert_eq!(tokens.len(), ps, "only full pages are published");
        let mut st = self.lock();
        assert!(st.refcount[page as usize] > 0, "publishing page {page} that nobody owns");
        assert!(st.meta[page as usize].is_none(), "page {page} is already published");
        if let Some(&q) = st.index.get(&hash) {
            let m = st.meta[q as usize].expect("indexed pages carry metadata");
            if m.parent == parent && st.page_tokens(q, ps) == tokens {
                return Publish::Duplicate(m.entry);
            }
            if !st.is_free(q) {
                return Publish::Conflict;
            }
            // A free page of other content under this hash: it holds nothing reachable
            // for this prefix; drop its hash and reuse it first.
            st.uncache(q);
            st.unlink(q);
            st.push_front(q);
        }
        let entry = st.next_entry;
        st.next_entry += 1;
        st.meta[page as usize] = Some(CacheMeta { hash, entry, parent });
        st.tokens[page as usize * ps..(page as usize + 1) * ps].copy_from_slice(tokens);
        st.index.insert(hash, page);
        Publish::Published(entry)
    }

    fn release(&self, pages: &[PageId]) {
        let mut st = self.lock();
        // Last page first: a prefix's deepest pages sit nearest the front and go first.
        for &p in pages.iter().rev() {
            let rc = &mut st.refcount[p as usize];
            assert!(*rc > 0, "page {p} released more often than it was owned");
            *rc -= 1;
            if *rc == 0 {
                if st.meta[p as usize].is_some() {
                    st.push_back(p);
                } else {
                    st.push_front(p);
                }
            }
        }
    }

    /// Free-list order, front first (the next pages to be handed out).
    pub fn free_pages(&self) -> Vec<PageId> {
        let st = self.lock();
        let mut out = Vec::with_capacity(st.num_free);
        let mut p = st.next[NULL_PAGE as usize];
        while p != NULL_PAGE && out.len() <= self.num_pages {
            out.push(p);
            p = st.next[p as usize];
        }
        out
    }

    /// Checks the pool's own invariants; returns a description of the first violation.
    pub fn check_integrity(&self) -> Result<(), String> {
        let st = self.lock();
        if st.refcount[NULL_PAGE as usize] != 0 {
            return Err("null page is owned".into());
        }
        if st.meta[NULL_PAGE as usize].is_some() {
            return Err("null page is published".into());
        }
        let mut on_list = vec![false; self.num_pages];
        let (mut p, mut count, mut back) = (st.next[NULL_PAGE as usize], 0usize, NULL_PAGE);
        while p != NULL_PAGE {
            if on_list[p as usize] {
                return Err(format!("page {p} is on the free list twice"));
            }
            if st.prev[p as usize] != back {
                return Err(format!("free list links broken at page {p}"));
            }
            on_list[p as usize] = true;
            if st.refcount[p as usize] != 0 {
                return Err(format!("page {p} is free and owned"));
            }
            count += 1;
            back = p;
            p = st.next[p as usize];
        }
        if st.prev[NULL_PAGE as usize] != back {
            return Err("free list back pointer is wrong".into());
        }
        if count != st.num_free {
            return Err(format!("free list holds {count} pages but counts {}", st.num_free));
        }
        for (p, (&rc, &free)) in st.refcount.iter().zip(&on_list).enumerate().skip(1) {
            if rc == 0 && !free {
                return Err(format!("page {p} is neither free nor owned (leaked)"));
            }
        }
        let mut published = 0;
        for (p, m) in st.meta.iter().enumerate() {
            if let Some(m) = m {
                published += 1;
                if st.index.get(&m.hash) != Some(&(p as PageId)) {
                    return Err(format!("published page {p} is not indexed under its hash"));
                }
                if m.entry == ROOT_ENTRY || m.entry >= st.next_entry || m.parent >= m.entry {
                    return Err(format!(
                        "page {p}: entry {} with parent {} is not a valid publication",
                        m.entry, m.parent
                    ));
                }
            }
        }
        if published != st.index.len() {
            return Err("the cache index and the published pages differ".into());
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

    pub fn pool(&self) -> &PagePool {
        &self.pool
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
        if st.num_free < want {
            return false;
        }
        for _ in 0..want {
            let page = st.pop_front();
            debug_assert_eq!(st.refcount[page as usize], 0);
            st.refcount[page as usize] = 1;
            self.pages.push(page);
        }
        true
    }

    /// Start an empty list with the cached pages `shared` (each gains an owner; a free one
    /// leaves the free list), then grow it to `n` pages. All or nothing.
    pub fn acquire_prefix(&mut self, shared: &[PageId], n: usize) -> bool {
        assert!(self.pages.is_empty(), "a prefix is acquired into an empty page list");
        assert!(n >= shared.len());
        let mut st = self.pool.lock();
        let revived = shared.iter().filter(|&&p| st.is_free(p)).count();
        if st.num_free - revived < n - shared.len() {
            return false;
        }
        for &p in shared {
            debug_assert!(st.meta[p as usize].is_some(), "only published pages are shared");
            if st.is_free(p) {
                st.unlink(p);
            }
            st.refcount[p as usize] += 1;
            self.pages.push(p);
        }
        drop(st);
        let grown = self.grow_to(n);
        debug_assert!(grown, "checked above");
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
    fn freed_pages_holding_nothing_are_reused_first_and_cached_ones_last() {
        let pool = PagePool::new(6, 4);
        let mut a = pool.empty_list();
        let mut b = pool.empty_list();
        assert!(pool.grow_to(&mut a, 2)); // pages 1, 2
        assert!(pool.grow_to(&mut b, 1)); // page 3
        assert_eq!(pool.publish(1, 11, ROOT_ENTRY, &[1, 2, 3, 4]), Publish::Published(1));
        drop(a);
        // Page 2 (nothing cached) is reused first; page 1 (cached) after the never-used 4, 5.
        assert_eq!(pool.free_pages(), vec![2, 4, 5, 1]);
        drop(b);
        assert_eq!(pool.free_pages(), vec![3, 2, 4, 5, 1]);
        pool.check_integrity().unwrap();
        // Handing out everything evicts the cached page last.
        let mut c = pool.empty_list();
        assert!(c.grow_to(4));
        assert_eq!((pool.num_cached(), pool.num_evictions()), (1, 0));
        assert!(c.grow_to(5));
        assert_eq!((pool.num_cached(), pool.num_evictions()), (0, 1));
        pool.check_integrity().unwrap();
    }

    #[test]
    fn a_request_frees_its_deepest_pages_first() {
        let pool = PagePool::new(5, 2);
        let mut a = pool.empty_list();
        assert!(a.grow_to(3)); // 1, 2, 3
        let mut parent = ROOT_ENTRY;
        for (i, &p) in [1u32, 2, 3].iter().enumerate() {
            let Publish::Published(e) = pool.publish(p, 100 + i as u64, parent, &[i as u32, 0]) else { panic!() };
            parent = e;
        }
        drop(a);
        // 4 (never used) first, then the deepest page 3, then 2, then the root page 1.
        assert_eq!(pool.free_pages(), vec![4, 3, 2, 1]);
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

    /// Publishes `tokens` (full pages) from a fresh list; returns the list and the hashes.
    fn publish_all(pool: &PagePool, tokens: &[u32]) -> (PageList, Vec<u64>) {
        let ps = pool.page_size();
        let n = tokens.len() / ps;
        let mut l = pool.empty_list();
        assert!(l.grow_to(n));
        let (mut parent, mut h, mut hashes) = (ROOT_ENTRY, 0u64, Vec::new());
        for j in 0..n {
            h = pool.page_hash(h, &tokens[j * ps..(j + 1) * ps]);
            hashes.push(h);
            match pool.publish(l.pages()[j], h, parent, &tokens[j * ps..(j + 1) * ps]) {
                Publish::Published(e) | Publish::Duplicate(e) => parent = e,
                Publish::Conflict => panic!("conflict"),
            }
        }
        (l, hashes)
    }

    #[test]
    fn a_hit_revives_free_cached_pages_from_the_middle_of_the_list() {
        let pool = PagePool::new(8, 2);
        let toks = [1, 2, 3, 4, 5, 6];
        let (a, hashes) = publish_all(&pool, &toks);
        let pages = a.pages().to_vec();
        drop(a);
        assert_eq!(pool.num_free(), 7);
        let hits = pool.match_prefix(&hashes, &toks);
        assert_eq!(hits.iter().map(|h| h.0).collect::<Vec<_>>(), pages);
        let mut b = pool.empty_list();
        assert!(b.acquire_prefix(&pages[..2], 3));
        assert_eq!(&b.pages()[..2], &pages[..2]);
        assert_eq!(pool.num_free(), 4);
        assert!(!pool.free_pages().contains(&pages[0]) && pool.free_pages().contains(&pages[2]));
        pool.check_integrity().unwrap();
        // All or nothing: 4 free pages, the 2 shared are not free now, 5 fresh wanted.
        let mut c = pool.empty_list();
        assert!(!c.acquire_prefix(&pages[..2], 7));
        assert!(c.is_empty() && pool.refcount(pages[0]) == 1);
        assert!(c.acquire_prefix(&pages[..2], 6));
        assert_eq!(pool.refcount(pages[0]), 2);
        pool.check_integrity().unwrap();
    }

    #[test]
    fn lookups_verify_tokens_and_parents_so_collisions_only_miss() {
        let pool = PagePool::new(16, 2);
        pool.set_hash_fn(|_, parent, toks| parent.wrapping_add(toks[0] as u64)); // collides often
        let (a, ha) = publish_all(&pool, &[1, 2, 3, 4]);
        // Same hashes (first tokens 1 and 3) but different second tokens: a miss, not a hit.
        let other = [1, 9, 3, 4];
        let hb = [pool.page_hash(0, &other[..2]), pool.page_hash(pool.page_hash(0, &other[..2]), &other[2..])];
        assert_eq!(hb.to_vec(), ha);
        assert!(pool.match_prefix(&hb, &other).is_empty());
        // Publishing the other content while `a` holds the slot: a conflict, nothing changes.
        let mut b = pool.empty_list();
        assert!(b.grow_to(1));
        assert_eq!(pool.publish(b.pages()[0], hb[0], ROOT_ENTRY, &other[..2]), Publish::Conflict);
        // Equal content: a duplicate of a's entry.
        let mut c = pool.empty_list();
        assert!(c.grow_to(1));
        let Publish::Duplicate(e) = pool.publish(c.pages()[0], ha[0], ROOT_ENTRY, &[1, 2]) else { panic!() };
        assert_eq!(Some(e), pool.cache_meta(a.pages()[0]).map(|m| m.entry));
        // Once a's pages are free, the other content takes the slot over.
        let a0 = a.pages()[0];
        drop(a);
        assert!(matches!(pool.publish(b.pages()[0], hb[0], ROOT_ENTRY, &other[..2]), Publish::Published(_)));
        assert_eq!(pool.cache_meta(a0), None);
        assert_eq!(pool.free_pages()[0], a0, "the displaced page is reused first");
        assert_eq!(pool.match_prefix(&hb, &other).len(), 1, "a's second page has another parent");
        pool.check_integrity().unwrap();
    }
}
