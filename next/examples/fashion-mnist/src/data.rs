//! Fashion-MNIST from its IDX files: where to find them, how to read them, how to batch them.
//!
//! Looked for, in order: `--data DIR`, `$FASHION_MNIST_DIR`, `/usr/share/datasets/fashion-mnist`
//! (Debian/Ubuntu package `dataset-fashion-mnist`), the cache directory
//! (`$XDG_CACHE_HOME/burn-ddp/fashion-mnist`, else `~/.cache/burn-ddp/fashion-mnist`), and finally
//! a download of the official files into the cache (feature `download`, on by default; the base
//! URL can be changed with `$FASHION_MNIST_URL`).

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use burn::data::dataloader::batcher::Batcher;
use burn::tensor::{Device, Int, Tensor, TensorData};
use flate2::read::GzDecoder;

/// Side of an image in pixels.
pub const SIDE: usize = 28;
/// Pixels per image.
pub const PIXELS: usize = SIDE * SIDE;
/// Mean and standard deviation of the training pixels (scaled to [0, 1]).
const MEAN: f32 = 0.2860;
const STD: f32 = 0.3530;

/// The official download location (Zalando Research's S3 bucket).
pub const OFFICIAL_URL: &str = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com";
/// Where Debian's and Ubuntu's `dataset-fashion-mnist` package installs the files.
pub const SYSTEM_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// The four files of the dataset (gzip-compressed IDX).
pub const FILES: [&str; 4] = [
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
];

/// One image with its class (0 T-shirt/top ... 9 ankle boot).
#[derive(Clone, Debug)]
pub struct FashionItem {
    /// 28 × 28 grey levels, row-major.
    pub pixels: Vec<u8>,
    /// Class index.
    pub label: u8,
}

/// The training and test sets.
#[derive(Debug)]
pub struct FashionMnist {
    /// 60,000 training images.
    pub train: Vec<FashionItem>,
    /// 10,000 test images.
    pub test: Vec<FashionItem>,
    /// The directory they were read from.
    pub source: PathBuf,
}

/// What went wrong while looking for or reading the dataset.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// No location had the files and the download failed (or is disabled).
    #[error(
        "Fashion-MNIST not found. Tried:\n{}\nTo get the files, do one of:\n  - sudo apt-get install dataset-fashion-mnist   (installs them in {SYSTEM_DIR})\n  - download {} from https://github.com/zalandoresearch/fashion-mnist#get-the-data into a directory DIR and pass --data DIR (or set FASHION_MNIST_DIR=DIR)",
        .attempts.iter().map(|a| format!("  - {a}")).collect::<Vec<_>>().join("\n"),
        FILES.join(", ")
    )]
    NotFound {
        /// One line per place tried, with why it failed.
        attempts: Vec<String>,
    },
    /// A file exists but is not a valid IDX file.
    #[error("{path}: {detail}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
}

/// Finds and reads the dataset (see the module docs for the search order).
///
/// # Errors
/// [`DataError::NotFound`] listing every place tried and how to get the files; [`DataError::Invalid`]
/// or [`DataError::Io`] when files exist but cannot be read.
pub fn load(explicit: Option<&Path>) -> Result<FashionMnist, DataError> {
    let mut attempts = Vec::new();
    let mut candidates: Vec<(String, PathBuf)> = Vec::new();
    if let Some(dir) = explicit {
        // An explicit directory is the only place looked at: a typo must not silently fall back.
        return match missing_files(dir) {
            None => read_dir(dir),
            Some(missing) => Err(DataError::NotFound {
                attempts: vec![format!("--data {}: missing {missing}", dir.display())],
            }),
        };
    }
    if let Some(dir) = std::env::var_os("FASHION_MNIST_DIR") {
        candidates.push(("$FASHION_MNIST_DIR".into(), PathBuf::from(dir)));
    }
    candidates.push(("system package".into(), PathBuf::from(SYSTEM_DIR)));
    let cache = cache_dir();
    if let Some(cache) = &cache {
        candidates.push(("cache".into(), cache.clone()));
    }
    for (what, dir) in &candidates {
        match missing_files(dir) {
            None => return read_dir(dir),
            Some(missing) => attempts.push(format!("{what} {}: missing {missing}", dir.display())),
        }
    }
    match &cache {
        Some(cache) => match download(cache) {
            Ok(()) => return read_dir(cache),
            Err(e) => attempts.push(format!("download into {}: {e}", cache.display())),
        },
        None => attempts.push("download: no cache directory (set HOME or XDG_CACHE_HOME)".into()),
    }
    Err(DataError::NotFound { attempts })
}

/// `$XDG_CACHE_HOME/burn-ddp/fashion-mnist`, else `$HOME/.cache/burn-ddp/fashion-mnist`.
pub fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("burn-ddp").join("fashion-mnist"))
}

/// The first of the four files missing from `dir` (compressed or not), if any.
fn missing_files(dir: &Path) -> Option<&'static str> {
    FILES
        .into_iter()
        .find(|name| !dir.join(name).is_file() && !dir.join(name.trim_end_matches(".gz")).is_file())
}

fn read_dir(dir: &Path) -> Result<FashionMnist, DataError> {
    let read = |name: &str| read_idx(&dir.join(name));
    let train = items(read(FILES[0])?, read(FILES[1])?, &dir.join(FILES[0]))?;
    let test = items(read(FILES[2])?, read(FILES[3])?, &dir.join(FILES[2]))?;
    Ok(FashionMnist {
        train,
        test,
        source: dir.to_path_buf(),
    })
}

/// An IDX file: its dimensions and its unsigned-byte payload.
#[derive(Debug, PartialEq, Eq)]
pub struct Idx {
    /// Dimensions, outermost first.
    pub dims: Vec<usize>,
    /// `product(dims)` bytes.
    pub data: Vec<u8>,
}

/// Reads an IDX file of unsigned bytes, gzip-compressed (`.gz`) or not; falls back to the name
/// without `.gz` when the compressed file is absent.
pub fn read_idx(path: &Path) -> Result<Idx, DataError> {
    let (path, gz) = if path.is_file() {
        (
            path.to_path_buf(),
            path.extension().is_some_and(|e| e == "gz"),
        )
    } else {
        (
            PathBuf::from(path.to_string_lossy().trim_end_matches(".gz")),
            false,
        )
    };
    let io_err = |source| DataError::Io {
        path: path.clone(),
        source,
    };
    let raw = fs::read(&path).map_err(io_err)?;
    let bytes = if gz {
        let mut out = Vec::new();
        GzDecoder::new(raw.as_slice())
            .read_to_end(&mut out)
            .map_err(io_err)?;
        out
    } else {
        raw
    };
    parse_idx(&bytes).map_err(|detail| DataError::Invalid { path, detail })
}

/// Parses IDX bytes: magic `0x00 0x00 0x08 ndims` (type 0x08: unsigned byte), `ndims` big-endian
/// `u32` sizes, then the data.
pub fn parse_idx(bytes: &[u8]) -> Result<Idx, String> {
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        return Err("not an IDX file (bad magic number)".into());
    }
    if bytes[2] != 0x08 {
        return Err(format!(
            "IDX element type {:#04x}, expected 0x08 (unsigned byte)",
            bytes[2]
        ));
    }
    let ndims = bytes[3] as usize;
    let header = 4 + 4 * ndims;
    if bytes.len() < header {
        return Err(format!(
            "truncated header: {} bytes for {ndims} dimensions",
            bytes.len()
        ));
    }
    let dims: Vec<usize> = (0..ndims)
        .map(|i| {
            let at = 4 + 4 * i;
            u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize
        })
        .collect();
    let expected: usize = dims.iter().product();
    let data = &bytes[header..];
    if data.len() != expected {
        return Err(format!(
            "dimensions {dims:?} need {expected} bytes of data, the file has {}",
            data.len()
        ));
    }
    Ok(Idx {
        dims,
        data: data.to_vec(),
    })
}

fn items(images: Idx, labels: Idx, path: &Path) -> Result<Vec<FashionItem>, DataError> {
    let invalid = |detail: String| DataError::Invalid {
        path: path.to_path_buf(),
        detail,
    };
    if images.dims.len() != 3 || images.dims[1] != SIDE || images.dims[2] != SIDE {
        return Err(invalid(format!(
            "images have dimensions {:?}, expected [n, 28, 28]",
            images.dims
        )));
    }
    if labels.dims.len() != 1 || labels.dims[0] != images.dims[0] {
        return Err(invalid(format!(
            "{} images but labels of dimensions {:?}",
            images.dims[0], labels.dims
        )));
    }
    if let Some(bad) = labels.data.iter().find(|&&l| l > 9) {
        return Err(invalid(format!("label {bad} is not a class in 0..=9")));
    }
    Ok(images
        .data
        .chunks(PIXELS)
        .zip(labels.data)
        .map(|(pixels, label)| FashionItem {
            pixels: pixels.to_vec(),
            label,
        })
        .collect())
}

/// Downloads the four files into `dir` (each written to a temporary name, then renamed, so an
/// interrupted download never leaves a partial file under the real name).
#[cfg(feature = "download")]
pub fn download(dir: &Path) -> Result<(), String> {
    let base = std::env::var("FASHION_MNIST_URL").unwrap_or_else(|_| OFFICIAL_URL.to_string());
    fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    for name in FILES {
        let target = dir.join(name);
        if target.is_file() {
            continue;
        }
        let url = format!("{}/{name}", base.trim_end_matches('/'));
        eprintln!("downloading {url}");
        let mut response = ureq::get(&url)
            .call()
            .map_err(|e| format!("GET {url}: {e}"))?;
        let mut body = Vec::new();
        response
            .body_mut()
            .with_config()
            .limit(64 * 1024 * 1024)
            .reader()
            .read_to_end(&mut body)
            .map_err(|e| format!("GET {url}: {e}"))?;
        let partial = dir.join(format!("{name}.partial"));
        fs::write(&partial, &body).map_err(|e| format!("{}: {e}", partial.display()))?;
        fs::rename(&partial, &target).map_err(|e| format!("{}: {e}", target.display()))?;
    }
    Ok(())
}

/// Downloading is disabled in this build.
#[cfg(not(feature = "download"))]
pub fn download(_dir: &Path) -> Result<(), String> {
    Err("this build has no download support (feature `download` is off)".into())
}

/// A batch: images `[batch, 1, 28, 28]` (normalised), targets `[batch]`.
#[derive(Clone, Debug)]
pub struct FashionBatch {
    /// Normalised images.
    pub images: Tensor<4>,
    /// Class indices.
    pub targets: Tensor<1, Int>,
}

/// Turns items into a normalised batch on a device.
#[derive(Clone, Default)]
pub struct FashionBatcher;

impl Batcher<FashionItem, FashionBatch> for FashionBatcher {
    fn batch(&self, items: Vec<FashionItem>, device: &Device) -> FashionBatch {
        let n = items.len();
        let pixels: Vec<f32> = items
            .iter()
            .flat_map(|i| i.pixels.iter().map(|&p| (p as f32 / 255.0 - MEAN) / STD))
            .collect();
        let labels: Vec<i64> = items.iter().map(|i| i.label as i64).collect();
        FashionBatch {
            images: Tensor::from_data(TensorData::new(pixels, [n, 1, SIDE, SIDE]), device),
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::Compression;
    use flate2::write::GzEncoder;
    use std::io::Write;

    fn idx(dims: &[u32], data: &[u8]) -> Vec<u8> {
        let mut out = vec![0, 0, 0x08, dims.len() as u8];
        for d in dims {
            out.extend_from_slice(&d.to_be_bytes());
        }
        out.extend_from_slice(data);
        out
    }

    fn gz(bytes: &[u8]) -> Vec<u8> {
        let mut encoder = GzEncoder::new(Vec::new(), Compression::fast());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    }

    /// Writes a tiny dataset (3 training images, 2 test images) in the official layout.
    fn write_dataset(dir: &Path) {
        let images = |n: usize| idx(&[n as u32, 28, 28], &vec![7u8; n * PIXELS]);
        fs::write(dir.join(FILES[0]), gz(&images(3))).unwrap();
        fs::write(dir.join(FILES[1]), gz(&idx(&[3], &[0, 5, 9]))).unwrap();
        fs::write(dir.join(FILES[2]), gz(&images(2))).unwrap();
        // Uncompressed test labels are accepted too.
        fs::write(dir.join("t10k-labels-idx1-ubyte"), idx(&[2], &[1, 2])).unwrap();
    }

    #[test]
    fn the_installed_dataset_has_6000_training_and_1000_test_images_per_class() {
        let dir = Path::new(SYSTEM_DIR);
        if let Some(missing) = missing_files(dir) {
            // CI installs the package and sets BURN_DDP_REQUIRE_DATA, so there this fails.
            assert!(
                std::env::var_os("BURN_DDP_REQUIRE_DATA").is_none(),
                "{SYSTEM_DIR} lacks {missing}: apt-get install dataset-fashion-mnist"
            );
            eprintln!(
                "skipped: {SYSTEM_DIR} lacks {missing} (apt-get install dataset-fashion-mnist)"
            );
            return;
        }
        let data = read_dir(dir).unwrap();
        let per_class = |items: &[FashionItem]| {
            let mut counts = [0usize; 10];
            items.iter().for_each(|i| counts[i.label as usize] += 1);
            counts
        };
        assert_eq!(per_class(&data.train), [6000; 10]);
        assert_eq!(per_class(&data.test), [1000; 10]);
        assert!(data.train.iter().all(|i| i.pixels.len() == PIXELS));
    }

    #[test]
    fn idx_files_parse_and_bad_ones_are_named() {
        let parsed = parse_idx(&idx(&[2, 3], &[1, 2, 3, 4, 5, 6])).unwrap();
        assert_eq!(parsed.dims, vec![2, 3]);
        assert_eq!(parsed.data, vec![1, 2, 3, 4, 5, 6]);
        assert!(
            parse_idx(&idx(&[2, 3], &[1, 2]))
                .unwrap_err()
                .contains("need 6 bytes")
        );
        assert!(parse_idx(b"PK\x03\x04").unwrap_err().contains("magic"));
        let mut float = idx(&[1], &[0, 0, 0, 0]);
        float[2] = 0x0d;
        assert!(parse_idx(&float).unwrap_err().contains("0x0d"));
    }

    #[test]
    fn an_explicit_directory_is_read_and_a_wrong_one_says_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        write_dataset(dir.path());
        let data = load(Some(dir.path())).unwrap();
        assert_eq!(data.train.len(), 3);
        assert_eq!(data.test.len(), 2);
        assert_eq!(data.train[2].label, 9);
        assert_eq!(data.test[1].label, 2);
        assert_eq!(data.train[0].pixels.len(), PIXELS);

        let empty = tempfile::tempdir().unwrap();
        let err = load(Some(empty.path())).unwrap_err().to_string();
        assert!(err.contains("missing train-images-idx3-ubyte.gz"), "{err}");
        assert!(
            err.contains("apt-get install dataset-fashion-mnist"),
            "{err}"
        );
    }

    #[test]
    fn labels_outside_the_ten_classes_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        write_dataset(dir.path());
        fs::write(dir.path().join(FILES[1]), gz(&idx(&[3], &[0, 5, 12]))).unwrap();
        let err = load(Some(dir.path())).unwrap_err().to_string();
        assert!(err.contains("label 12"), "{err}");
    }

    #[cfg(feature = "download")]
    #[test]
    fn downloads_the_files_from_a_server_into_the_cache() {
        use std::net::TcpListener;
        let source = tempfile::tempdir().unwrap();
        write_dataset(source.path());
        // The download fetches the four .gz names: provide the compressed test labels too.
        let labels = fs::read(source.path().join("t10k-labels-idx1-ubyte")).unwrap();
        fs::write(source.path().join(FILES[3]), gz(&labels)).unwrap();

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let root = source.path().to_path_buf();
        let server = std::thread::spawn(move || {
            for _ in 0..FILES.len() {
                let (mut stream, _) = listener.accept().unwrap();
                stream
                    .set_read_timeout(Some(std::time::Duration::from_secs(10)))
                    .unwrap();
                let mut request = [0u8; 2048];
                let n = stream.read(&mut request).unwrap();
                let line = String::from_utf8_lossy(&request[..n]).to_string();
                let name = line
                    .split_whitespace()
                    .nth(1)
                    .unwrap()
                    .trim_start_matches('/');
                let body = fs::read(root.join(name)).unwrap();
                write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                )
                .unwrap();
                stream.write_all(&body).unwrap();
            }
        });
        let target = tempfile::tempdir().unwrap();
        // SAFETY: this is the only test that reads or writes FASHION_MNIST_URL.
        unsafe { std::env::set_var("FASHION_MNIST_URL", format!("http://{addr}")) };
        download(target.path()).unwrap();
        server.join().unwrap();
        let data = read_dir(target.path()).unwrap();
        assert_eq!(data.train.len(), 3);
        assert_eq!(
            data.test.iter().map(|i| i.label).collect::<Vec<_>>(),
            vec![1, 2]
        );
    }
}
