//! Output pumping: every line a worker prints, prefixed with its rank, to the launcher's own
//! output and to the worker's log file.

use std::io::{BufRead, BufReader, Write};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Copies a worker's output line by line, prefixed with `[rank R] `, to `sink` and `log`.
pub(super) fn pump(
    stream: impl std::io::Read + Send + 'static,
    rank: usize,
    sink: Arc<Mutex<impl Write + Send + 'static>>,
    log: Option<Arc<Mutex<std::fs::File>>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let prefixed = [format!("[rank {rank}] ").as_bytes(), &line].concat();
                    if let Ok(mut sink) = sink.lock() {
                        let _ = sink.write_all(&prefixed);
                        let _ = sink.flush();
                    }
                    if let Some(log) = &log
                        && let Ok(mut file) = log.lock()
                    {
                        let _ = file.write_all(&prefixed);
                    }
                }
            }
        }
    })
}
