//! The watching source: the initial list, then inotify (or polling) events collected, debounced
//! and turned into re-reads of the changed files only.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use super::state::{is_candidate_name, load, Batch, DirState, LoadResult, SourceStats};
use super::{StaticDirError, DEFAULT_DEBOUNCE};
use model::event::{Object, SourceEvent};

/// Most changed paths remembered between two batches; beyond, the next batch rescans the
/// directory (bounded memory whatever happens in the directory).
const MAX_PENDING_PATHS: usize = 4096;

/// Default polling interval when inotify is unavailable.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(2);

/// Quiet time after changes that all completed (every named file was closed after writing,
/// renamed into place or removed): the file is whole, the wait only gathers what a tool writes
/// together. Other changes (a write still open, a new empty file, a rescan) wait the debounce.
pub const SETTLE_AFTER_COMPLETE: Duration = Duration::from_millis(20);

/// What the watcher saw since the last batch.
#[derive(Debug, Default)]
struct PendingState {
    paths: BTreeSet<PathBuf>,
    /// Paths whose last event was not a completed write (see [`SETTLE_AFTER_COMPLETE`]).
    open: BTreeSet<PathBuf>,
    rescan: bool,
    first: Option<Instant>,
    last: Option<Instant>,
}

/// Changes queued by the inotify callback for the source task.
#[derive(Debug, Default)]
struct Pending {
    state: std::sync::Mutex<PendingState>,
    wake: tokio::sync::Notify,
}

impl Pending {
    fn lock(&self) -> std::sync::MutexGuard<'_, PendingState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records one watcher event (called on notify's thread).
    fn record(&self, dir: &Path, res: notify::Result<notify::Event>) {
        use notify::event::{AccessKind, AccessMode, EventKind};
        let mut st = self.lock();
        match res {
            Err(e) => {
                tracing::warn!(source = "static-dir", "watch error: {e}; rescanning");
                st.rescan = true;
            }
            Ok(ev) => {
                use notify::event::{ModifyKind, RenameMode};
                match ev.kind {
                    // Opening or reading a file changes nothing (and the source's own reads
                    // would otherwise re-trigger it forever); a close after writing does.
                    EventKind::Access(AccessKind::Close(AccessMode::Write)) => {}
                    EventKind::Access(_) => return,
                    EventKind::Other | EventKind::Any => st.rescan = true,
                    _ => {}
                }
                // The file is whole after a close-after-write, a rename into place (or away)
                // and a removal; a write without a close yet, a new (empty) file or a change
                // of attributes may be followed by more.
                let complete = matches!(
                    ev.kind,
                    EventKind::Access(AccessKind::Close(AccessMode::Write))
                        | EventKind::Modify(ModifyKind::Name(
                            RenameMode::To | RenameMode::From | RenameMode::Both
                        ))
                        | EventKind::Remove(_)
                );
                if ev.need_rescan() {
                    st.rescan = true;
                }
                for path in ev.paths {
                    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                    if path.parent() != Some(dir) || name.starts_with("..") {
                        // The directory itself, or a ConfigMap volume's `..data` swap: every
                        // file may have changed.
                        st.rescan = true;
                    } else if is_candidate_name(&path) {
                        if st.paths.len() >= MAX_PENDING_PATHS {
                            st.rescan = true;
                            st.paths.clear();
                            st.open.clear();
                        }
                        if !st.rescan {
                            if complete {
                                st.open.remove(&path);
                            } else {
                                st.open.insert(path.clone());
                            }
                            st.paths.insert(path);
                        }
                    } else {
                        // Hidden files (editors' temporaries) and other extensions.
                        continue;
                    }
                }
                if !st.rescan && st.paths.is_empty() {
                    return;
                }
            }
        }
        let now = Instant::now();
        st.first.get_or_insert(now);
        st.last = Some(now);
        drop(st);
        self.wake.notify_one();
    }

    /// Waits until something is pending and has been quiet for `debounce` (only
    /// [`SETTLE_AFTER_COMPLETE`] when every pending file's last change completed; at most
    /// `4 × debounce` after the first change), then takes it.
    async fn take(&self, debounce: Duration) -> PendingState {
        loop {
            let deadline = {
                let st = self.lock();
                let quiet = if st.rescan || !st.open.is_empty() {
                    debounce
                } else {
                    SETTLE_AFTER_COMPLETE.min(debounce)
                };
                match (st.first, st.last) {
                    (Some(first), Some(last)) => Some((last + quiet).min(first + debounce * 4)),
                    _ => None,
                }
            };
            match deadline {
                None => self.wake.notified().await,
                Some(d) if Instant::now() >= d => {
                    let mut st = self.lock();
                    let mut taken = std::mem::take(&mut *st);
                    if taken.rescan {
                        taken.paths.clear();
                    }
                    return taken;
                }
                // A new event may bring the deadline forward (a write completing): wake for
                // it too.
                Some(d) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(tokio::time::Instant::from_std(d)) => {}
                        _ = self.wake.notified() => {}
                    }
                }
            }
        }
    }
}

/// The static directory source: reads the directory, then watches it.
#[derive(Debug, Clone)]
pub struct StaticDirSource {
    dir: PathBuf,
    node_name: String,
    debounce: Duration,
    poll: Option<Duration>,
    stats: Arc<SourceStats>,
}

fn log_batch(batch: &Batch) {
    for w in &batch.warnings {
        tracing::warn!(source = "static-dir", "{w}");
    }
    for e in &batch.errors {
        tracing::error!(source = "static-dir", "skipping file: {e}");
    }
}

fn log_result(result: &LoadResult) {
    for w in &result.snapshot.warnings {
        tracing::warn!(source = "static-dir", "{w}");
    }
    for e in &result.errors {
        tracing::error!(source = "static-dir", "skipping file: {e}");
    }
}

/// Runs blocking directory work off the async workers, moving the state in and out.
async fn blocking<T: Send + 'static>(
    mut state: DirState,
    f: impl FnOnce(&mut DirState) -> T + Send + 'static,
) -> Result<(DirState, T), StaticDirError> {
    let dir = state.dir.clone();
    tokio::task::spawn_blocking(move || {
        let out = f(&mut state);
        (state, out)
    })
    .await
    .map_err(|e| StaticDirError::Reader {
        dir,
        message: e.to_string(),
    })
}

impl StaticDirSource {
    /// A source for `dir` on the node named `node_name`.
    pub fn new(dir: impl Into<PathBuf>, node_name: impl Into<String>) -> Self {
        Self {
            dir: dir.into(),
            node_name: node_name.into(),
            debounce: DEFAULT_DEBOUNCE,
            poll: None,
            stats: Arc::default(),
        }
    }

    /// Sets the debounce between a change and the re-read.
    pub fn with_debounce(mut self, debounce: Duration) -> Self {
        self.debounce = debounce;
        self
    }

    /// Polls every `interval` instead of using inotify (what the source falls back to when
    /// inotify is unavailable).
    pub fn with_polling(mut self, interval: Duration) -> Self {
        self.poll = Some(interval);
        self
    }

    /// The work counters of this source (shared with its running task).
    pub fn stats(&self) -> Arc<SourceStats> {
        self.stats.clone()
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads the directory once, logging warnings and skipped files.
    pub fn load(&self) -> Result<LoadResult, StaticDirError> {
        let result = load(&self.dir, &self.node_name)?;
        log_result(&result);
        Ok(result)
    }

    /// Emits the directory's objects as a list (`Init`/`InitApply`/`InitDone` per kind), then,
    /// like a watch, `Apply`/`Delete` for the objects each change alters; a change re-reads
    /// only the files it touched.
    ///
    /// Returns `Ok(())` when `tx`'s receiver is dropped. Fails if the directory cannot be read
    /// or watched at start; later read failures (e.g. the directory vanished) are logged and the
    /// last state is kept.
    pub async fn run(self, tx: mpsc::Sender<SourceEvent>) -> Result<(), StaticDirError> {
        let watch_err = |e: notify::Error| StaticDirError::Watch {
            dir: self.dir.clone(),
            message: e.to_string(),
        };
        let pending = Arc::new(Pending::default());
        let mut poll = self.poll;
        let mut _watcher = None;
        if poll.is_none() {
            let p = pending.clone();
            let dir = self.dir.clone();
            let watcher =
                notify::recommended_watcher(move |res| p.record(&dir, res)).and_then(|mut w| {
                    // Watch before the first read, so no change between the two is missed.
                    w.watch(&self.dir, RecursiveMode::NonRecursive).map(|()| w)
                });
            match watcher {
                Ok(w) => _watcher = Some(w),
                Err(e) if !self.dir.is_dir() => return Err(watch_err(e)),
                Err(e) => {
                    tracing::warn!(
                        source = "static-dir",
                        dir = %self.dir.display(),
                        interval_s = DEFAULT_POLL_INTERVAL.as_secs_f64(),
                        "inotify unavailable ({e}): polling the directory instead"
                    );
                    poll = Some(DEFAULT_POLL_INTERVAL);
                }
            }
        } else if !self.dir.is_dir() {
            return Err(StaticDirError::Watch {
                dir: self.dir.clone(),
                message: "not a directory".into(),
            });
        }

        let mut state = DirState::new(&self.dir, &self.node_name);
        state.stats = self.stats.clone();
        let (state_back, first) = blocking(state, |s| s.scan(false)).await?;
        state = state_back;
        let first = first?;
        log_batch(&first);
        // Its events hold the objects the relist lists again.
        drop(first);
        let relist = state.relist();
        let count = |f: fn(&Object) -> bool| {
            (relist.iter())
                .filter(|e| matches!(e, SourceEvent::InitApply(o) if f(o)))
                .count()
        };
        let node = relist.iter().find_map(|e| match e {
            SourceEvent::InitApply(Object::Node(n)) => n.metadata.name.clone(),
            _ => None,
        });
        tracing::info!(
            source = "static-dir",
            dir = %self.dir.display(),
            files = state.files.values().filter(|e| e.has_good).count(),
            services = count(|o| matches!(o, Object::Service(_))),
            endpoint_slices = count(|o| matches!(o, Object::EndpointSlice(_))),
            node = node.as_deref().unwrap_or_default(),
            "read static directory"
        );
        for ev in relist {
            if tx.send(ev).await.is_err() {
                return Ok(());
            }
        }
        loop {
            let (rescan, paths) = match poll {
                Some(interval) => {
                    tokio::select! {
                        _ = tx.closed() => return Ok(()),
                        () = tokio::time::sleep(interval) => {}
                    }
                    (true, BTreeSet::new())
                }
                None => {
                    let taken = tokio::select! {
                        _ = tx.closed() => return Ok(()),
                        t = pending.take(self.debounce) => t,
                    };
                    (taken.rescan, taken.paths)
                }
            };
            let stamps = poll.is_some();
            let (state_back, result) = blocking(state, move |s| {
                if rescan {
                    s.scan(stamps)
                } else {
                    Ok(s.read_paths(&paths, false))
                }
            })
            .await?;
            state = state_back;
            let batch = match result {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(source = "static-dir", "{e}; keeping the last state");
                    continue;
                }
            };
            log_batch(&batch);
            if batch.events.is_empty() {
                tracing::debug!(source = "static-dir", "files changed, objects did not");
                continue;
            }
            tracing::info!(
                source = "static-dir",
                changes = batch.events.len(),
                "static directory changed"
            );
            for ev in batch.events {
                if tx.send(ev).await.is_err() {
                    return Ok(());
                }
            }
        }
    }
}
