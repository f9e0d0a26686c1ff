// Each figure of a tutorial opens at full size: a click on it follows a link
// to the image file itself (Sphinx-Gallery's figures are bare images).
document.addEventListener("DOMContentLoaded", () => {
  for (const img of document.querySelectorAll("img.sphx-glr-single-img, img.sphx-glr-multi-img")) {
    if (img.closest("a")) continue;
    const link = document.createElement("a");
    link.href = img.getAttribute("src");
    link.className = "figure-full-size";
    link.title = "Open the figure at full size";
    img.replaceWith(link);
    link.appendChild(img);
  }
});
