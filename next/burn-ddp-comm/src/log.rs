//! Messages the user must see: a warning that changes what is trained goes to the console
//! (stderr) as well as to `tracing`, because burn-train's application logger sends `tracing`
//! events to its `experiment.log` only. Their `tracing` target is `burn_ddp_comm::log`: a subscriber
//! that prints to the console too can leave it out (`burn_ddp_comm::log=off`) to avoid seeing them twice.

use std::collections::HashSet;
use std::sync::Mutex;

/// Logs `message` as a `tracing` warning and prints it to stderr, once per process and message
/// (ranks that are threads of one process would print it once each otherwise).
pub fn warn_console(message: &str) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    tracing::warn!("burn-ddp: {message}");
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if seen
        .get_or_insert_with(HashSet::new)
        .insert(message.to_string())
    {
        to_stderr(&format!("burn-ddp: warning: {message}\n"));
    }
}

/// Logs `message` as a `tracing` info event and prints it to stderr.
pub fn info_console(message: &str) {
    tracing::info!("burn-ddp: {message}");
    to_stderr(&format!("burn-ddp: {message}\n"));
}

/// Writes `text` to stderr in one write (`eprintln!` writes its pieces one by one, and
/// `mpirun --tag-output` and `srun --label` prefix every write, splitting lines). A failed write
/// (stderr closed) is ignored, as `eprint!` would panic instead.
pub fn to_stderr(text: &str) {
    use std::io::Write;
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}
