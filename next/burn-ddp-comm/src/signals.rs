//! Stop requests by signal: SIGTERM (what clusters send before they preempt a job), SIGINT
//! (Ctrl-C) and SIGHUP.
//!
//! While something is *armed* (a burn-ddp's `DdpStrategy` run, or the launcher), these
//! signals are only recorded, so the training can stop at a step boundary and write a checkpoint
//! (the launcher: stop its workers gracefully). SIGTERM and SIGHUP stay recorded however often
//! they come: a cluster may send SIGTERM to every process of a job and the launcher pass it on
//! again, and the SIGKILL that follows a grace period is the backstop. A second SIGINT (Ctrl-C
//! twice) ends the process at once. While nothing is armed, every signal has its default effect.
//! The handlers are installed once per process with `signal-hook`, on the first arming. A signal
//! the process inherited as ignored (SIGHUP under `nohup`) is left ignored: it stops nothing.

/// The exit code of a process that stopped because of a stop signal, after its checkpoint:
/// 143, which shells also report for a process ended by SIGTERM (128 + 15). Workers stopped by
/// SIGTERM or SIGINT exit with it (the example and `ddp-worker` map
/// burn-ddp's `DdpError::Preempted` to it; plain `SupervisedTraining::launch`
/// exits with it), and so does `burn-ddp run` when it stopped its workers after a signal.
pub const PREEMPTED_EXIT_CODE: i32 = 143;

#[cfg(unix)]
mod imp {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex, OnceLock};

    /// The signals handled.
    const SIGNALS: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

    struct State {
        /// True while nothing is armed: every signal has its default effect.
        disarmed: Arc<AtomicBool>,
        /// True when a SIGINT must have its default effect: nothing armed, or one was received.
        terminate: Arc<AtomicBool>,
        /// The last signal received while armed (0: none).
        received: Arc<AtomicUsize>,
        /// How many arms are alive.
        armed: Mutex<usize>,
    }

    static STATE: OnceLock<Option<State>> = OnceLock::new();

    fn state() -> Option<&'static State> {
        STATE
            .get_or_init(|| {
                let state = State {
                    disarmed: Arc::new(AtomicBool::new(true)),
                    terminate: Arc::new(AtomicBool::new(true)),
                    received: Arc::new(AtomicUsize::new(0)),
                    armed: Mutex::new(0),
                };
                for signal in SIGNALS {
                    // A signal the process inherited as ignored (`nohup` ignores SIGHUP) stays
                    // ignored: it stops nothing, during training or after.
                    if ignored(signal) {
                        continue;
                    }
                    // Actions run in registration order: the default effect first (when
                    // nothing is armed, or for a second SIGINT), then note the signal (and, for
                    // SIGINT, make the next one fatal).
                    let sigint = signal == libc::SIGINT;
                    let fatal = if sigint {
                        state.terminate.clone()
                    } else {
                        state.disarmed.clone()
                    };
                    let installed = (|| -> std::io::Result<()> {
                        signal_hook::flag::register_conditional_default(signal, fatal)?;
                        signal_hook::flag::register_usize(
                            signal,
                            state.received.clone(),
                            signal as usize,
                        )?;
                        if sigint {
                            signal_hook::flag::register(signal, state.terminate.clone())?;
                        }
                        Ok(())
                    })();
                    if let Err(e) = installed {
                        tracing::warn!(
                            "burn-ddp: cannot handle signal {signal}: {e}; it will end the \
                             process without a checkpoint"
                        );
                        return None;
                    }
                }
                Some(state)
            })
            .as_ref()
    }

    /// Whether `signal`'s disposition is "ignore" (inherited from the parent, e.g. `nohup`).
    fn ignored(signal: i32) -> bool {
        // SAFETY: `sigaction` with a null new action only reads the current one into `current`,
        // a zeroed `sigaction` owned by this frame.
        unsafe {
            let mut current: libc::sigaction = std::mem::zeroed();
            libc::sigaction(signal, std::ptr::null(), &mut current) == 0
                && current.sa_sigaction == libc::SIG_IGN
        }
    }

    /// Keeps stop signals recorded (not fatal) until dropped.
    pub struct Armed {
        active: bool,
    }

    pub fn arm() -> Armed {
        let Some(state) = state() else {
            return Armed { active: false };
        };
        let mut armed = state.armed.lock().unwrap_or_else(|p| p.into_inner());
        if *armed == 0 {
            // A new run: forget a signal an earlier run already acted on.
            state.received.store(0, Ordering::SeqCst);
            state.terminate.store(false, Ordering::SeqCst);
            state.disarmed.store(false, Ordering::SeqCst);
        }
        *armed += 1;
        Armed { active: true }
    }

    impl Drop for Armed {
        fn drop(&mut self) {
            let Some(state) = self.active.then(state).flatten() else {
                return;
            };
            let mut armed = state.armed.lock().unwrap_or_else(|p| p.into_inner());
            *armed = armed.saturating_sub(1);
            if *armed == 0 {
                state.disarmed.store(true, Ordering::SeqCst);
                state.terminate.store(true, Ordering::SeqCst);
            }
        }
    }

    pub fn received() -> Option<i32> {
        let state = state()?;
        match state.received.load(Ordering::SeqCst) {
            0 => None,
            signal => Some(signal as i32),
        }
    }
}

#[cfg(not(unix))]
mod imp {
    pub struct Armed;

    pub fn arm() -> Armed {
        Armed
    }

    pub fn received() -> Option<i32> {
        None
    }
}

pub use imp::Armed;

/// Records stop signals instead of letting them end the process, until the guard is dropped
/// (see the [module docs](self)).
pub fn arm() -> Armed {
    imp::arm()
}

/// The stop signal received while armed, if any.
pub fn received() -> Option<i32> {
    imp::received()
}

/// "SIGTERM", "SIGINT", ... for the signals this module handles and a few more.
pub fn name(signal: i32) -> &'static str {
    #[cfg(unix)]
    {
        match signal {
            libc::SIGHUP => "SIGHUP",
            libc::SIGINT => "SIGINT",
            libc::SIGQUIT => "SIGQUIT",
            libc::SIGILL => "SIGILL",
            libc::SIGABRT => "SIGABRT",
            libc::SIGBUS => "SIGBUS",
            libc::SIGFPE => "SIGFPE",
            libc::SIGKILL => "SIGKILL",
            libc::SIGSEGV => "SIGSEGV",
            libc::SIGPIPE => "SIGPIPE",
            libc::SIGTERM => "SIGTERM",
            _ => "unknown signal",
        }
    }
    #[cfg(not(unix))]
    {
        let _ = signal;
        "unknown signal"
    }
}
