//! Client-side rate limit of Kubernetes API requests: `clientConnection.qps` / `burst`.
//!
//! Like client-go's default (`flowcontrol.NewTokenBucketRateLimiter(qps, burst)`, used by
//! upstream kube-proxy through `rest.Config.QPS/Burst`): a token bucket that holds up to
//! `burst` tokens, refills at `qps` per second and starts full; every request takes one token
//! and waits until it is available. A watch is one request (its long-lived response body is
//! not metered), a paginated list is one request per page. `qps <= 0` disables the limit (as
//! in client-go, where no rate limiter is installed then); a burst of 0 is treated as 1.
//!
//! [`QpsLayer`] is a tower layer added to kube's client stack (`ClientBuilder::with_layer`).
//! kube wraps the stack in a `Buffer`, so all requests of one client share one bucket and
//! wait in order. A wait over one second is logged, like client-go's "Waited for … due to
//! client-side throttling".

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// A token bucket with time passed in (pure; tests inject it).
#[derive(Debug, Clone)]
pub struct TokenBucket {
    qps: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket of `burst` tokens refilling at `qps` per second.
    pub fn new(qps: f64, burst: u32, now: Instant) -> TokenBucket {
        let burst = f64::from(burst.max(1));
        TokenBucket {
            qps,
            burst,
            tokens: burst,
            last: now,
        }
    }

    /// Takes one token at `now` and returns how long the caller must wait before using it
    /// (zero when one was available). Tokens are reserved in order: callers that wait are
    /// spaced `1/qps` apart.
    pub fn reserve(&mut self, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        if now > self.last {
            self.last = now;
        }
        self.tokens = (self.tokens + elapsed * self.qps).min(self.burst);
        self.tokens -= 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.qps)
        }
    }
}

/// The tower layer: every request through it takes a token first.
#[derive(Debug, Clone)]
pub struct QpsLayer {
    bucket: Option<Arc<Mutex<TokenBucket>>>,
}

impl QpsLayer {
    /// `qps` requests per second with bursts of `burst`; `qps <= 0` (or not finite): no limit.
    pub fn new(qps: f64, burst: u32) -> QpsLayer {
        let bucket = (qps > 0.0 && qps.is_finite())
            .then(|| Arc::new(Mutex::new(TokenBucket::new(qps, burst, Instant::now()))));
        QpsLayer { bucket }
    }
}

impl<S> tower::Layer<S> for QpsLayer {
    type Service = QpsService<S>;
    fn layer(&self, inner: S) -> QpsService<S> {
        QpsService {
            inner,
            bucket: self.bucket.clone(),
            wait: None,
            granted: false,
        }
    }
}

/// The service [`QpsLayer`] wraps around kube's stack.
pub struct QpsService<S> {
    inner: S,
    bucket: Option<Arc<Mutex<TokenBucket>>>,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
    granted: bool,
}

impl<S> std::fmt::Debug for QpsService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QpsService")
            .field("limited", &self.bucket.is_some())
            .field("granted", &self.granted)
            .finish_non_exhaustive()
    }
}

impl<S, R> tower::Service<R> for QpsService<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if let (Some(bucket), false) = (&self.bucket, self.granted) {
            if self.wait.is_none() {
                let wait = {
                    let mut b = match bucket.lock() {
                        Ok(g) => g,
                        Err(p) => p.into_inner(),
                    };
                    b.reserve(Instant::now())
                };
                if wait.is_zero() {
                    self.granted = true;
                } else {
                    if wait > Duration::from_secs(1) {
                        tracing::info!(
                            wait_seconds = wait.as_secs_f64(),
                            "waiting due to client-side throttling (clientConnection.qps/burst)"
                        );
                    }
                    self.wait = Some(Box::pin(tokio::time::sleep(wait)));
                }
            }
            if let Some(w) = &mut self.wait {
                if w.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.wait = None;
                self.granted = true;
            }
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> S::Future {
        self.granted = false;
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use tower::{Layer, Service};

    #[test]
    fn bucket_starts_full_then_spaces_requests_at_qps() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(5.0, 10, t0);
        // The burst passes at once.
        for _ in 0..10 {
            assert_eq!(b.reserve(t0), Duration::ZERO);
        }
        // Then each request waits one more 1/qps (reservations queue up).
        for i in 1..=5u32 {
            let w = b.reserve(t0).as_secs_f64();
            assert!((w - f64::from(i) * 0.2).abs() < 1e-9, "{i}: {w}");
        }
        // After the queued ones are due, the bucket refills at qps up to the burst only.
        let later = t0 + Duration::from_secs(3600);
        for _ in 0..10 {
            assert_eq!(b.reserve(later), Duration::ZERO);
        }
        assert!(b.reserve(later) > Duration::ZERO, "burst is the cap");
        // Half a second of refill at 5 qps: 2.5 tokens.
        let mut b = TokenBucket::new(5.0, 1, t0);
        assert_eq!(b.reserve(t0), Duration::ZERO);
        let w = b.reserve(t0 + Duration::from_millis(100)).as_secs_f64();
        assert!((w - 0.1).abs() < 1e-9, "{w}");
        // Burst 0 is 1.
        let mut b = TokenBucket::new(1.0, 0, t0);
        assert_eq!(b.reserve(t0), Duration::ZERO);
        assert!(b.reserve(t0) > Duration::ZERO);
    }

    #[test]
    fn time_going_backwards_never_adds_tokens() {
        let t0 = Instant::now() + Duration::from_secs(10);
        let mut b = TokenBucket::new(1.0, 1, t0);
        assert_eq!(b.reserve(t0), Duration::ZERO);
        assert!(b.reserve(t0 - Duration::from_secs(5)) > Duration::ZERO);
    }

    /// A service that counts calls and is always ready.
    struct Count(usize);
    impl Service<()> for Count {
        type Response = ();
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<(), Self::Error>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: ()) -> Self::Future {
            self.0 += 1;
            std::future::ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn layer_admits_the_burst_then_holds_requests_back() {
        let mut svc = QpsLayer::new(0.001, 3).layer(Count(0));
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        for _ in 0..3 {
            assert!(svc.poll_ready(&mut cx).is_ready());
            svc.call(()).await.unwrap();
        }
        // The fourth waits (1,000 s at 0.001 qps): not ready, and polling again does not take
        // another token.
        assert!(svc.poll_ready(&mut cx).is_pending());
        assert!(svc.poll_ready(&mut cx).is_pending());
        assert_eq!(svc.inner.0, 3);
        // Without a limit, always ready.
        let mut free = QpsLayer::new(0.0, 0).layer(Count(0));
        for _ in 0..1000 {
            assert!(free.poll_ready(&mut cx).is_ready());
            free.call(()).await.unwrap();
        }
        assert_eq!(free.inner.0, 1000);
    }
}
